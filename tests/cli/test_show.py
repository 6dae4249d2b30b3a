"""cli/show.py: `dflash-pipeline show` prints the contract of each kind of folder and refuses
damaged weights in one line."""

import shutil
from pathlib import Path

from support.console import assert_one_line_error, invoke
from support.helpers import flip_a_byte

from dflash_pipeline.drafters.checkpoints import load_checkpoint
from dflash_pipeline.export.run import export_checkpoint
from dflash_pipeline.target.load import TargetInfo


def contract(result) -> dict[str, str]:
    assert result.exit_code == 0, result.output
    pairs = (line.partition(":") for line in result.stdout.splitlines()[1:] if line.startswith("  "))
    return {key.strip(): value.strip() for key, _, value in pairs}


def test_show_refuses_damaged_weights_in_one_line(cli_run, tmp_path):
    checkpoint = shutil.copytree(cli_run.checkpoint, tmp_path / "step_000004")
    export = shutil.copytree(cli_run.export, tmp_path / "export")
    assert "sha256 matches checkpoint.json" in contract(invoke("show", checkpoint))["weights"]
    assert "sha256 of 3 file(s) match dflash_pipeline.json" in contract(invoke("show", export))["weights"]
    flip_a_byte(checkpoint / "model.safetensors")
    flip_a_byte(export / "model.safetensors")
    assert_one_line_error(invoke("show", checkpoint), f"{checkpoint / 'model.safetensors'}: damaged (sha256 ", "checkpoint.json records")
    assert_one_line_error(invoke("show", export), f"{export / 'model.safetensors'}: damaged (sha256 ", "dflash_pipeline.json records")


def dflash_checkpoint(checkpoint: Path, out_dir: Path) -> Path:
    """A plain-DFlash checkpoint of `checkpoint`'s sizes and record (random weights): step_NNNNNN under `out_dir`'s parent."""
    from dataclasses import replace

    from dflash_pipeline.drafters.checkpoints import save_checkpoint
    from dflash_pipeline.drafters.core import DFlashDrafter

    drafter, info = load_checkpoint(checkpoint)
    own = ("format_version", "step", "drafter", "git_revision", "metrics", "weights_sha256", "resume_state_sha256")
    plain = DFlashDrafter(replace(drafter.config, architecture="dflash", options=None))
    return save_checkpoint(out_dir.parent, step=info["step"], drafter=plain, record={k: v for k, v in info.items() if k not in own},
                           metrics=info["metrics"])


def test_show_detects_each_kind_of_folder(cli_run, tmp_path):
    fingerprint = TargetInfo.from_json(cli_run.target_json).fingerprint
    checkpoint = contract(invoke("show", cli_run.checkpoint))
    # the default architecture, DFlash2, named as what it is (it used to read "DFlash drafter")
    assert checkpoint["kind"] == "training checkpoint of a DFlash2 drafter" and checkpoint["step"] == "4"
    assert checkpoint["target fingerprint"] == fingerprint and checkpoint["target layer ids"] == "[1, 3]"
    assert checkpoint["hidden size"] == "64" and checkpoint["block size"].startswith("4 ") and checkpoint["weights"].startswith("float32")
    assert checkpoint["mask token id"].startswith(str(load_checkpoint(cli_run.checkpoint)[0].config.mask_token_id))

    exported = contract(invoke("show", cli_run.export))
    assert exported["kind"] == "DFlash2 drafter (serving format)" and exported["target fingerprint"] == fingerprint
    assert str(cli_run.checkpoint) in exported["exported from"]
    for key in ("target layer ids", "hidden size", "block size", "mask token id", "vocab size", "drafter layers"):
        assert exported[key] == checkpoint[key], key

    split = contract(invoke("show", cli_run.val))
    assert split["kind"].startswith("shard split 'val'") and split["target fingerprint"] == fingerprint
    assert split["target layer ids"] == "[1, 3]" and split["sequences"] == "3" and split["feature dtype"] == "bf16"
    both = invoke("show", cli_run.hidden)
    assert both.exit_code == 0 and "shard split 'train'" in both.stdout and "shard split 'val'" in both.stdout

    dflash = export_checkpoint(dflash_checkpoint(cli_run.checkpoint, tmp_path / "dflash" / "step_000004"), tmp_path / "dflash-export")
    assert contract(invoke("show", dflash))["kind"] == "DFlash drafter (serving format)"
    assert contract(invoke("show", tmp_path / "dflash" / "step_000004"))["kind"] == "training checkpoint of a DFlash drafter"

    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("show", tmp_path / "empty"), "not a checkpoint folder")
    assert_one_line_error(invoke("show", cli_run.root / "checkpoints"), "name one of its step_NNNNNN folders")
