"""drafters/checkpoints.py: a step folder round-trips the drafter exactly, appears whole or not at
all, records the digests of its weights and resume state, and a damaged one (a flipped bit too) is
one line naming the file."""

import json
import re
import shutil

import pytest
import torch
from support.helpers import flip_a_byte, strict_json_load

from dflash_pipeline.drafters.checkpoints import (
    list_checkpoints,
    load_checkpoint,
    load_resume_state,
    remove_checkpoints,
    save_checkpoint,
    save_step,
    state_path,
    step_folder,
)
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import sha256_file


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


def test_a_checkpoint_from_before_the_options_were_nested_loads_the_same_drafter(tmp_path):
    torch.manual_seed(3)
    drafter = DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8, vocab_size=50, block_size=4, target_layer_ids=(0, 2), num_target_layers=3,
                                          mask_token_id=49, architecture="dflash2",
                                          options=dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)))
    folder = save_checkpoint(tmp_path, step=4, drafter=drafter, record={}, metrics={})
    info = json.loads((folder / "checkpoint.json").read_text())
    recorded = info["drafter"]
    assert recorded["architecture"] == "dflash2" and recorded["dflash2"]["selector_rank"] == 6 and "selector_rank" not in recorded
    info["drafter"] = {**{k: v for k, v in recorded.items() if k != "dflash2"}, **recorded["dflash2"]}  # the old flat layout
    (folder / "checkpoint.json").write_text(json.dumps(info))
    loaded, _ = load_checkpoint(folder)
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


def test_a_flipped_bit_in_the_weights_is_refused_naming_the_file_and_an_old_checkpoint_loads_unchecked(tmp_path):
    folder = save_checkpoint(tmp_path, step=3, drafter=tiny_drafter(), record={}, metrics={})
    weights = folder / "model.safetensors"
    assert json.loads((folder / "checkpoint.json").read_text())["weights_sha256"] == sha256_file(weights)
    flip_a_byte(weights)  # inside a tensor: the header parses, the numbers are wrong
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(weights))}: damaged \(sha256 [0-9a-f]{{12}}\.\.\., checkpoint.json "
                                            rf"records [0-9a-f]{{12}}\.\.\.\)$"):
        load_checkpoint(folder)
    # A checkpoint written before digests records none: nothing to check, and it loads as before.
    info = json.loads((folder / "checkpoint.json").read_text())
    del info["weights_sha256"]
    (folder / "checkpoint.json").write_text(json.dumps(info))
    load_checkpoint(folder)


def test_checkpoint_and_state_json_are_strict_json(tmp_path):
    # The interval of one val prompt is infinite: it is null in every file, never a bare Infinity.
    curve = [{"step": 1, "loss": 2.0, "tau": 1.5, "tau_ci95": float("inf"), "slot1_acc": float("nan")}]
    optimizer = torch.optim.AdamW(tiny_drafter().parameters())
    folder = save_step(tmp_path, step=1, drafter=tiny_drafter(), optimizer=optimizer, curve=curve, record={"seed": 0},
                       metrics={"tau_tf": 1.5, "tau_tf_ci95": float("inf")})
    assert strict_json_load(folder / "checkpoint.json")["metrics"]["tau_tf_ci95"] is None
    assert strict_json_load(tmp_path / "state.json")["curve"][0]["tau_ci95"] is None
    info = json.loads((folder / "checkpoint.json").read_text())
    assert info["resume_state_sha256"] == sha256_file(state_path(tmp_path, 1))


def test_a_flipped_bit_in_the_newest_resume_state_passes_it_over_for_the_step_before(tmp_path):
    drafter = tiny_drafter()
    optimizer = torch.optim.AdamW(drafter.parameters())
    for step in (2, 4):
        save_step(tmp_path, step=step, drafter=drafter, optimizer=optimizer, curve=[], record={"seed": 0}, metrics={})
    assert load_resume_state(tmp_path, {"seed": 0}).step == 4
    flip_a_byte(state_path(tmp_path, 4))
    point = load_resume_state(tmp_path, {"seed": 0})
    assert point.step == 2 and len(point.skipped) == 1
    assert point.skipped[0].startswith(f"step_000004: {state_path(tmp_path, 4)}: damaged (sha256 "), point.skipped


def test_a_step_without_its_resume_state_says_why_it_has_none(tmp_path):
    # After `verify --repair` removed a damaged step 4 with every newer one, train said step 2 had
    # "no resume state (the run stopped before writing it)"; it was the keep-two rule.
    drafter = tiny_drafter()
    optimizer = torch.optim.AdamW(drafter.parameters())
    for step in (2, 4, 6):
        save_step(tmp_path, step=step, drafter=drafter, optimizer=optimizer, curve=[], record={"seed": 0}, metrics={})
    flip_a_byte(state_path(tmp_path, 6))
    flip_a_byte(state_path(tmp_path, 4))
    point = load_resume_state(tmp_path, {"seed": 0})
    assert point.step == 0 and point.skipped[2] == (f"step_000002: {state_path(tmp_path, 2)}: no resume state "
                                                   "(only the newest 2 checkpoints keep one)"), point.skipped
    for step in (4, 6):  # what `verify --repair` removes for a damaged step 4
        shutil.rmtree(tmp_path / f"step_{step:06d}")
        state_path(tmp_path, step).unlink()
    point = load_resume_state(tmp_path, {"seed": 0})
    assert point.step == 0 and point.skipped == [f"step_000002: {state_path(tmp_path, 2)}: no resume state (only the newest 2 "
                                                 "checkpoints keep one, and the newer steps that had one were removed)"]
