"""drafters/checkpoints.py: a step folder round-trips the drafter exactly, appears whole or not at
all, and a damaged one is one line naming the file."""

import json
import re

import pytest
import torch

from dflash_pipeline.drafters.checkpoints import list_checkpoints, load_checkpoint, remove_checkpoints, save_checkpoint, step_folder
from dflash_pipeline.drafters.core import DFlashDrafter, DrafterConfig
from dflash_pipeline.errors import PipelineError


def tiny_drafter(seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=8, vocab_size=50, block_size=4, target_layer_ids=(0, 2), num_target_layers=3,
                                       mask_token_id=49))


def test_a_checkpoint_round_trips_weights_config_metrics_and_record(tmp_path):
    drafter = tiny_drafter()
    folder = save_checkpoint(tmp_path, step=12, drafter=drafter, record={"target_fingerprint": "abc"}, metrics={"loss": 1.5})
    assert folder == step_folder(tmp_path, 12) == tmp_path / "step_000012"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.json", "model.safetensors"]
    loaded, info = load_checkpoint(folder)
    assert (info["step"], info["metrics"], info["target_fingerprint"]) == (12, {"loss": 1.5}, "abc")
    assert loaded.config == drafter.config
    for (name, ours), (other, theirs) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert name == other and torch.equal(ours, theirs)


def test_only_complete_step_folders_are_listed_oldest_first_and_removal_keeps_the_older(tmp_path):
    for step in (20, 5, 10):
        save_checkpoint(tmp_path, step=step, drafter=tiny_drafter(), record={}, metrics={})
    (tmp_path / "step_000030.tmp").mkdir()  # a writer killed before its rename
    (tmp_path / "step_000040").mkdir()  # no checkpoint.json
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005", "step_000010", "step_000020"]
    assert remove_checkpoints(tmp_path, newer_than=5) == 3  # 10, 20 and the empty 40 (a .tmp is not counted)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005"] and not (tmp_path / "step_000030.tmp").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "checkpoint.json").unlink(), "no checkpoint.json (not a checkpoint folder)"),
    (lambda f: (f / "checkpoint.json").write_text("{cut"), "checkpoint.json: not valid JSON"),
    (lambda f: (f / "checkpoint.json").write_text(json.dumps({"format_version": 0})), "checkpoint.json: format_version 0, expected 1"),
    (lambda f: (f / "model.safetensors").unlink(), "model.safetensors: missing"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 10), "model.safetensors: unreadable safetensors file"),
])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, damage, message):
    folder = save_checkpoint(tmp_path, step=1, drafter=tiny_drafter(), record={}, metrics={})
    damage(folder)
    with pytest.raises(PipelineError, match=re.escape(message)) as caught:
        load_checkpoint(folder)
    assert "\n" not in str(caught.value)
