"""train/resume.py: rerun, resume after a kill (kill -9 too) and after damaged checkpoints, exactly
the uninterrupted curve, loss and weights; another run configuration starts fresh saying why."""

import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.helpers import flip_a_byte, run, start_then_kill_9
from support.stage_commands import TINY_DFLASH2, TINY_TRAIN, train_stage_cmd, train_tiny_run, untimed

from dflash_pipeline.drafters.checkpoints import list_checkpoints, load_checkpoint
from dflash_pipeline.foundation.errors import PipelineError


def test_rerun_resumes_and_other_configurations_start_fresh(tiny_run, tmp_path):
    out = tmp_path / "ck"
    full = train_tiny_run(tiny_run, out)
    again = train_tiny_run(tiny_run, out)
    assert again.resumed_from == 6 and again.curve == full.curve
    changed = train_tiny_run(tiny_run, out, replace(TINY_TRAIN, lr=2e-3))
    assert changed.resumed_from == 0 and changed.curve[0]["loss"] == full.curve[0]["loss"]
    assert changed.curve[-1]["loss"] != full.curve[-1]["loss"]


def test_rerunning_a_finished_run_reports_its_metrics_from_the_saved_state(tiny_run, tmp_path):
    # A rerun caused by an unrelated change "resumes" at the last step with nothing to do; its
    # metrics must be the finished run's, not an empty loop's (loss null, 0 tokens/s).
    first = train_tiny_run(tiny_run, tmp_path / "ck")
    again = train_tiny_run(tiny_run, tmp_path / "ck")
    assert again.resumed_from == TINY_TRAIN.max_steps
    assert again.loss == first.loss and isinstance(first.loss, float)
    assert again.tokens_per_s == first.tokens_per_s and first.tokens_per_s > 0
    assert again.seconds == first.seconds and first.seconds > 0
    assert (again.held_out.tau.mean, again.held_out.slot_accuracy) == (first.held_out.tau.mean, first.held_out.slot_accuracy)


def _train_killed_after_the_state_of(step, tiny_run, out, config, monkeypatch):
    """Run `config` into `out` and stop it like a kill right after step `step`'s resume state is in
    place, before state.json follows (the readable copy then still describes the step before)."""
    import dflash_pipeline.drafters.checkpoints as checkpoints_module

    real_write = checkpoints_module.write_json_atomic

    def killed(path, data):
        if Path(path).name == "state.json" and data["step"] == step:
            raise KeyboardInterrupt(f"killed after the state of step {step}")
        real_write(path, data)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints_module, "write_json_atomic", killed)
        with pytest.raises(KeyboardInterrupt):
            train_tiny_run(tiny_run, out, config)


def test_a_kill_between_the_state_files_resumes_exactly(tiny_run, tmp_path, monkeypatch):
    # A kill after state/step_000004.pt is in place but before state.json follows: the two files
    # disagree. Resuming must take step, optimizer and curve from one of them (the .pt file), or the
    # step-2 weights would continue with step-4 optimizer moments (a flaky kill -9 test found it).
    config = replace(TINY_TRAIN, save_every=2)
    full = train_tiny_run(tiny_run, tmp_path / "reference", config)
    out = tmp_path / "ck"
    _train_killed_after_the_state_of(4, tiny_run, out, config, monkeypatch)
    assert json.loads((out / "state.json").read_text())["step"] == 2  # the files disagree
    resumed = train_tiny_run(tiny_run, out, config)
    assert resumed.resumed_from == 4
    assert [row["loss"] for row in resumed.curve] == [row["loss"] for row in full.curve]


def test_a_resumed_run_reports_the_loss_of_the_uninterrupted_one(tiny_run, tmp_path, monkeypatch):
    # The reported loss is the mean of the last LOSS_WINDOW steps: after a resume the window must
    # hold the steps before the kill too, not only the ones run since (the 6 steps here all fit).
    config = replace(TINY_TRAIN, save_every=2)
    full = train_tiny_run(tiny_run, tmp_path / "reference", config)
    out = tmp_path / "ck"
    _train_killed_after_the_state_of(4, tiny_run, out, config, monkeypatch)
    resumed = train_tiny_run(tiny_run, out, config)
    assert resumed.resumed_from == 4 and isinstance(full.loss, float)
    assert resumed.loss == full.loss
    last = json.loads((out / "step_000006" / "checkpoint.json").read_text())["metrics"]
    uninterrupted = json.loads((tmp_path / "reference" / "step_000006" / "checkpoint.json").read_text())["metrics"]
    assert last["loss"] == full.loss == uninterrupted["loss"]


def _weights(folder):
    return load_checkpoint(folder)[0].state_dict()


def test_a_damaged_or_missing_last_checkpoint_resumes_from_the_one_before(tiny_run, tmp_path):
    config = replace(TINY_TRAIN, save_every=2)
    reference = train_tiny_run(tiny_run, tmp_path / "reference", config)
    expected = _weights(tmp_path / "reference" / "step_000006")
    out = tmp_path / "ck"
    train_tiny_run(tiny_run, out, config)
    assert sorted(p.name for p in (out / "state").iterdir()) == ["step_000004.pt", "step_000006.pt"]  # the newest two

    # A model.safetensors cut short: one line naming it, and the run goes on from step 4.
    weights = out / "step_000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(weights))}: unreadable safetensors file \([^\n]*\)$"):
        load_checkpoint(weights.parent)
    for damage in ("cut", "deleted"):
        messages = []
        resumed = train_tiny_run(tiny_run, out, config, log=messages.append)
        said = [m for m in messages if "resum" in m or "fresh" in m]
        why = f"{weights}: unreadable safetensors file" if damage == "cut" else f"{weights.parent}: checkpoint folder missing"
        assert len(said) == 1 and said[0].startswith(f"train: resuming at step 4 from {out / 'step_000004'}; passed over and removed newer "
                                                    f"step_000006: {why}"), said
        assert resumed.resumed_from == 4 and untimed(resumed.curve) == untimed(reference.curve)
        assert resumed.loss == reference.loss and resumed.held_out.tau.mean == reference.held_out.tau.mean
        assert [p.name for p in list_checkpoints(out)] == ["step_000002", "step_000004", "step_000006"]  # older ones kept
        final = _weights(out / "step_000006")
        assert all(torch.equal(final[name], expected[name]) for name in expected)
        shutil.rmtree(out / "step_000006")  # the second round: the newest folder is gone

    # A checkpoint.json that does not parse is one line too.
    info = out / "step_000002" / "checkpoint.json"
    info.write_text('{"step": 2,')
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(info))}: not valid JSON \([^\n]*\)$"):
        load_checkpoint(info.parent)
    # Nothing left to continue from, but the checkpoints are this configuration's: starting over
    # must not claim they belong to another one.
    shutil.rmtree(out / "state")
    messages = []
    assert train_tiny_run(tiny_run, out, config, log=messages.append).resumed_from == 0
    said = [m for m in messages if "resum" in m or "fresh" in m]
    assert len(said) == 1 and said[0].startswith("train: starting fresh: no checkpoint of this run configuration can be continued "
                                                 "(step_000004: "), said
    assert "different run configuration" not in said[0]


def test_a_bit_flip_in_the_newest_weights_is_passed_over_like_a_cut_file(tiny_run, tmp_path):
    # One flipped byte inside a tensor (the header intact) used to resume from those weights, and a
    # rerun of the finished run reported the saved loss and tau, which no longer described them.
    config = replace(TINY_TRAIN, save_every=2)
    reference = train_tiny_run(tiny_run, tmp_path / "reference", config)
    expected = _weights(tmp_path / "reference" / "step_000006")
    out = tmp_path / "ck"
    train_tiny_run(tiny_run, out, config)
    weights = out / "step_000006" / "model.safetensors"
    flip_a_byte(weights)
    messages = []
    resumed = train_tiny_run(tiny_run, out, config, log=messages.append)
    said = [m for m in messages if "resum" in m or "fresh" in m]
    assert len(said) == 1 and said[0].startswith(f"train: resuming at step 4 from {out / 'step_000004'}; passed over and removed newer "
                                                f"step_000006: {weights}: damaged (sha256 "), said
    assert resumed.resumed_from == 4 and untimed(resumed.curve) == untimed(reference.curve)
    final = _weights(out / "step_000006")
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def test_a_longer_schedule_starts_over_and_says_which_key_changed(tiny_run, tmp_path):
    # README: train.max_steps is part of the run's record, since the learning-rate schedule runs to
    # it; a run resumed at step 4 of 4 toward 6 would be another model than a fresh 6-step one.
    out = tmp_path / "ck"
    short = replace(TINY_TRAIN, max_steps=4, save_every=2, eval_every=2)
    train_tiny_run(tiny_run, out, short)
    messages = []
    longer = train_tiny_run(tiny_run, out, replace(short, max_steps=6), log=messages.append)
    said = [m for m in messages if "fresh" in m]
    assert said == ["train: starting fresh; removing 2 checkpoint(s) of a different run configuration "
                    "(train_config.max_steps 4 -> 6)"], messages
    assert longer.resumed_from == 0
    fresh = train_tiny_run(tiny_run, tmp_path / "fresh", replace(short, max_steps=6))
    assert untimed(longer.curve) == untimed(fresh.curve)
    # compile is the one train key a run resumes across (how fast a step runs, not what it computes).
    from dflash_pipeline.drafters.build import RUNTIME_ONLY_KEYS

    assert RUNTIME_ONLY_KEYS == ("compile",)


def test_a_run_folder_from_before_per_checkpoint_states_still_resumes(tiny_run, tmp_path):
    # Earlier versions kept one state.pt for the newest checkpoint; a finished default run in the
    # DVC cache has that layout and must not be retrained from step 0.
    out = tmp_path / "ck"
    first = train_tiny_run(tiny_run, out)
    (out / "state" / "step_000006.pt").rename(out / "state.pt")
    shutil.rmtree(out / "state")
    again = train_tiny_run(tiny_run, out)
    assert again.resumed_from == 6 and again.loss == first.loss


@pytest.mark.subprocess
def test_kill_9_then_rerun_gives_the_uninterrupted_curve(tiny_run, tmp_path):
    reference = tmp_path / "reference" / "ck"
    run(train_stage_cmd(tmp_path, tiny_run, reference, max_steps=120, save_every=4, eval_every=40), cwd=tmp_path)
    expected = json.loads((reference / "state.json").read_text())["curve"]

    out = tmp_path / "killed" / "ck"
    start_then_kill_9(train_stage_cmd(tmp_path, tiny_run, out, max_steps=120, save_every=4, eval_every=40), tmp_path,
                      lambda: len(list_checkpoints(out)) >= 3)
    assert (out / "state.json").exists() and not (out / "step_000120").exists()
    result = run(train_stage_cmd(tmp_path, tiny_run, out, max_steps=120, save_every=4, eval_every=40), cwd=tmp_path)
    assert "resuming at step" in result.stdout + result.stderr
    # Its output is a file here, not a terminal: plain progress lines, no bar redrawn per step.
    assert "\r" not in result.stderr and len(result.stderr.splitlines()) < 15, result.stderr
    resumed = json.loads((out / "state.json").read_text())["curve"]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected]
    assert resumed[-1]["tau"] == expected[-1]["tau"]
    metrics = json.loads((out.parent / "m.json").read_text())
    assert metrics["steps"] == 120 and (out.parent / "plots" / "train.png").stat().st_size > 1000
    assert (out.parent / "plots" / "train_tau.csv").read_text().startswith("step,tau,tau_ci95,acc_slot1")


def test_dflash2_trains_resumes_exactly_and_is_its_own_run_configuration(tiny_run, tmp_path, monkeypatch):
    config = replace(TINY_DFLASH2, save_every=2)
    full = train_tiny_run(tiny_run, tmp_path / "reference", config)
    losses = [row["loss"] for row in full.curve]
    assert all(math.isfinite(loss) for loss in losses) and "selector_acc" in full.curve[0]
    drafter, info = load_checkpoint(tmp_path / "reference" / "step_000006")
    assert info["drafter"]["architecture"] == "dflash2" and info["train_config"]["selector_top_k"] == 4
    assert drafter.config.options.selector_rank == 8 and hasattr(drafter, "candidate_selector")

    out = tmp_path / "ck"
    _train_killed_after_the_state_of(4, tiny_run, out, config, monkeypatch)
    resumed = train_tiny_run(tiny_run, out, config)
    assert resumed.resumed_from == 4 and [row["loss"] for row in resumed.curve] == losses
    # The same run but DFlash: another configuration, so it starts fresh instead of resuming DFlash2 weights.
    dflash = train_tiny_run(tiny_run, out, replace(config, architecture="dflash"))
    assert dflash.resumed_from == 0 and dflash.curve[0]["loss"] != losses[0]
    assert "selector_acc" not in dflash.curve[0]
    assert "architecture" not in load_checkpoint(out / "step_000006")[1]["train_config"]  # a dflash record as before
