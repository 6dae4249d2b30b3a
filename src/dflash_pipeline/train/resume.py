"""Checkpoints of a run: resume from the newest intact checkpoint of the same run configuration or
start fresh (saying why, and removing what cannot be continued), and save a step's checkpoint with
the resume state (`drafters.checkpoints` holds the files' format)."""

from pathlib import Path

import torch

from dflash_pipeline.drafters.checkpoints import (
    list_checkpoints,
    load_resume_state,
    record_changes,
    remove_checkpoints,
    save_step,
    step_folder,
)
from dflash_pipeline.train.distributed import check_every_rank_resumes_at
from dflash_pipeline.train.record import held_out_tau, window_loss
from dflash_pipeline.train.state import LOSS_WINDOW, TrainingRun


def _listed(skipped: list[str], limit: int = 2) -> str:
    return "; ".join(skipped[:limit]) + (f"; and {len(skipped) - limit} more" if len(skipped) > limit else "")


def resume_or_start_fresh(run: TrainingRun, out_dir: Path, *, log) -> None:
    """Continue from the newest intact checkpoint of this run configuration (saying which newer ones
    were passed over and why, then removing those), or start fresh and remove what is there."""
    import torch.distributed as dist

    point = load_resume_state(out_dir, run.record) if run.config.resume else None
    if run.world > 1:
        check_every_rank_resumes_at(point.state["step"] if point is not None and point.state is not None else 0, device=run.device)
        dist.barrier()  # every rank has looked before rank 0 removes anything
    if point is not None and point.state is not None:
        state = point.state
        run.drafter.load_state_dict(point.drafter.state_dict())
        run.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        run.start_step, run.curve = state["step"], state["curve"]
        run.last_saved = run.start_step
        # The reported loss is a moving mean: rebuild its window, not just the steps after the resume.
        run.recent_losses = list(state.get("recent_losses") or [row["loss"] for row in run.curve[-LOSS_WINDOW:]])
        run.tokens_seen, run.seconds = int(state.get("tokens_seen", 0)), float(state.get("seconds", 0.0))
        if run.rank == 0:
            passed_over = f"; passed over and removed newer {_listed(point.skipped)}" if point.skipped else ""
            log(f"train: resuming at step {run.start_step} from {step_folder(out_dir, run.start_step)}{passed_over}")
            remove_checkpoints(out_dir, newer_than=run.start_step)
    elif run.rank == 0:
        stale = len(list_checkpoints(out_dir))
        if point is None:
            message = f"starting fresh (train.resume is false); removing {stale} checkpoint(s)" if stale else ""
        elif point.same_configuration:
            message = (f"starting fresh: no checkpoint of this run configuration can be continued ({_listed(point.skipped)}); "
                       f"removing {stale} checkpoint(s)")
        else:
            # Every key of the record is part of what the run computes: train.max_steps too, since the
            # learning-rate schedule runs to it (README, "Parameters and experiments").
            changes = f" ({record_changes(point.other_record, run.record)})" if point.other_record is not None else ""
            message = f"starting fresh; removing {stale} checkpoint(s) of a different run configuration{changes}" if point.skipped else ""
        if message:
            log(f"train: {message}")
        remove_checkpoints(out_dir)
    if run.world > 1:
        dist.barrier()


def save_checkpoint(run: TrainingRun, out_dir: Path, step: int) -> None:
    """Step `step`'s checkpoint and resume state, with the run's figures so far as its metrics."""
    held_out = held_out_tau(run.curve)
    metrics = {"step": step, "loss": window_loss(run.recent_losses), "tau_tf": held_out.tau.mean if held_out else None,
               "tau_tf_ci95": held_out.tau.ci95 if held_out else None}
    save_step(out_dir, step=step, drafter=run.drafter, optimizer=run.optimizer, curve=run.curve, record=run.record, metrics=metrics,
              extra={"recent_losses": run.recent_losses, "tokens_seen": run.tokens_seen, "seconds": run.seconds})
    run.last_saved = step
