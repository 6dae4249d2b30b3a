"""The typed train record: what a training run reports, kept as dataclasses until the stage writes
it.

    HeldOutTau   the newest periodic validation in the curve: teacher-forced τ over val prompts
                 and each slot's acceptance
    TrainRecord  a run's final figures (steps, resume point, loss, held-out τ, throughput) and its curve

Exactly one function writes a record as metrics keys (`train.report.to_metrics`, the keys of
data/metrics/train.json); nothing reads keys back into a record. The curve stays a list of rows
(dicts): it is what a checkpoint's resume state stores and what `report.write_curves` writes,
with fields an architecture adds (`Architecture.curve_fields`).

The two rules shared by the record and a checkpoint's metrics live here too: the reported loss is
the mean of the last LOSS_WINDOW step losses (`window_loss`), and the held-out τ is the newest
validated curve row's (`held_out_tau`).
"""

from dataclasses import dataclass, field

from dflash_pipeline.measure.record import Interval


@dataclass(frozen=True)
class HeldOutTau:
    """A periodic validation (`validation.validation_tau`) as its curve row keeps it: rounded to
    4 places, the interval's half-width nan over a single val prompt."""

    step: int
    tau: Interval
    slot_accuracy: list[float] | None  # slot 1..B-1: the drafted token is the target's (teacher-forced)


@dataclass(frozen=True)
class TrainRecord:
    """A training run's final figures. Ranks other than 0 keep no curve, so their `held_out` is None."""

    steps: int  # train.max_steps
    resumed_from: int  # the step this invocation started at (0: a fresh run)
    last_checkpoint: int  # the newest checkpoint's step
    loss: float | None  # the mean of the last LOSS_WINDOW step losses (`window_loss`)
    held_out: HeldOutTau | None  # the newest periodic validation
    tokens_per_s: float | None  # context tokens per training second, over all ranks and resumed invocations
    seconds: float  # training time, resumed invocations included
    mask_token_id: int
    curve: list[dict] = field(default_factory=list)  # one row per step, `tau` in the validated ones


def window_loss(recent_losses: list[float]) -> float | None:
    """The reported loss: the mean of the window of recent step losses, to 6 places."""
    return round(sum(recent_losses) / len(recent_losses), 6) if recent_losses else None


def held_out_tau(curve: list[dict]) -> HeldOutTau | None:
    """The newest validated row of the curve, or None when no step was validated."""
    row = next((row for row in reversed(curve) if "tau" in row), None)
    if row is None:
        return None
    return HeldOutTau(step=row["step"], tau=Interval(row["tau"], row.get("tau_ci95")), slot_accuracy=row.get("slot_accuracy"))
