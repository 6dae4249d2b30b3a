"""cli/export.py: `dflash-pipeline export` writes a serving-format folder that loads back, and
refuses what it must not replace."""

import torch
from support.console import assert_one_line_error, invoke

from dflash_pipeline.drafters.checkpoints import load_checkpoint
from dflash_pipeline.drafters.serving import load_dflash_drafter


def test_export_writes_a_folder_that_loads_back(cli_run, tmp_path):
    result = invoke("export", cli_run.checkpoint, tmp_path / "drafter", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert "bfloat16" in result.stdout
    drafter, info = load_dflash_drafter(tmp_path / "drafter")
    original, _ = load_checkpoint(cli_run.checkpoint)
    assert info["stored_dtype"] == "bfloat16" and info["provenance"]["source"]["step"] == 4
    assert drafter.config == original.config
    # The feature scale travels folded into fc.weight; the draft vocabulary in its own file.
    expected = {**original.state_dict(), "fc.weight": original.folded_fc_weight().detach(),
                "feature_scale": torch.ones_like(original.feature_scale)}
    assert not torch.equal(original.feature_scale, expected["feature_scale"])  # the default recipe scales
    for name, tensor in expected.items():
        if name == "draft_vocab":
            assert original.draft_vocab.numel() > 0 and torch.equal(drafter.draft_vocab, original.draft_vocab)
            continue
        assert torch.equal(drafter.state_dict()[name], tensor.to(torch.bfloat16).float()), name

    assert_one_line_error(invoke("export", cli_run.export, tmp_path / "again"), "no checkpoint.json")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    assert_one_line_error(invoke("export", cli_run.checkpoint, tmp_path / "precious"), "refusing to replace it")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    assert_one_line_error(invoke("export", cli_run.checkpoint, tmp_path / "x", "--dtype", "int8"), "--dtype")
