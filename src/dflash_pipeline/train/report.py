"""The train stage's report: train.json (the record's final figures, `to_metrics`) and the
training curves (CSV for `dvc plots`, and a PNG of loss and held-out τ). Only `train` runs this
module, so editing it makes no other stage stale. An interval that does not exist (one val prompt)
is null in train.json and an empty cell in the CSV files (`files.csv_cell`)."""

from pathlib import Path

from dflash_pipeline.foundation.files import pyplot, save_figure, write_csv_atomic, write_metrics
from dflash_pipeline.train.record import TrainRecord

# train.json names the first few slots' held-out acceptance; the curves CSV has every slot.
METRIC_SLOTS = 4


def to_metrics(record: TrainRecord) -> dict:
    """The record as train.json's flat keys (docs/metrics-keys.md): the one place they are named."""
    held_out = record.held_out
    metrics = {
        "steps": record.steps,
        "resumed_from": record.resumed_from,
        "last_checkpoint": record.last_checkpoint,
        "loss": record.loss,
        "tau_tf": held_out.tau.mean if held_out else None,
        "tau_tf_ci95": held_out.tau.ci95 if held_out else None,
        "tokens_per_s": record.tokens_per_s,
        "seconds": record.seconds,
        "mask_token_id": record.mask_token_id,
    }
    slots = (held_out.slot_accuracy if held_out else None) or []
    metrics.update({f"slot{k + 1}_acc": accuracy for k, accuracy in enumerate(slots[:METRIC_SLOTS])})
    return metrics


def write_train_outputs(record: TrainRecord, *, metrics_path: Path, plots_dir: Path) -> dict:
    """train.json (`to_metrics`) and the curves (`write_curves`); returns the metrics."""
    write_curves(record.curve, plots_dir)
    metrics = to_metrics(record)
    write_metrics(metrics_path, metrics)
    return metrics


def write_curves(curve: list[dict], plots_dir: Path) -> None:
    """CSV curves for `dvc plots` (loss per step; τ per evaluation) and a PNG of both."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(plots_dir / "train_loss.csv", ["step", "loss", "slot1_acc"], curve)
    evaluated = [row for row in curve if "tau" in row]
    slots = len(evaluated[0]["slot_accuracy"]) if evaluated else 0
    write_csv_atomic(plots_dir / "train_tau.csv", ["step", "tau", "tau_ci95"] + [f"acc_slot{k + 1}" for k in range(slots)],
                     [{**row, **{f"acc_slot{k + 1}": accuracy for k, accuracy in enumerate(row["slot_accuracy"])}} for row in evaluated])
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in curve], [r["loss"] for r in curve], lw=0.8)
    left.set(xlabel="step", ylabel="decayed CE loss", title="training loss")
    if evaluated:
        right.errorbar([r["step"] for r in evaluated], [r["tau"] for r in evaluated], yerr=[r["tau_ci95"] for r in evaluated],
                       marker="o", capsize=3)
    right.set(xlabel="step", ylabel="held-out teacher-forced tau", title="acceptance length (95% CI over prompts)")
    save_figure(figure, plots_dir / "train.png")
