"""DVC stage `train`: train (or resume) the DFlash drafter on the captured shards.

    python stages/train.py --params params.yaml --hidden data/hidden --target data/target/target.json \
        --out data/checkpoints --metrics data/metrics/train.json --plots data/plots
    torchrun --nproc_per_node 8 stages/train.py ...   # data parallel over GPUs (or gloo on CPU)
"""

import csv
import json
import os
from pathlib import Path

import click

from dflash_pipeline.runtime import default_device, offline_by_default, one_line_errors


def write_curves(curve: list[dict], plots_dir: Path) -> None:
    """CSV curves for `dvc plots` and a PNG of them."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    with open(plots_dir / "train_loss.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss", "slot1_acc"])
        writer.writerows([row["step"], row["loss"], row["slot1_acc"]] for row in curve)
    evaluated = [row for row in curve if "tau" in row]
    with open(plots_dir / "train_tau.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        slots = len(evaluated[0]["slot_accuracy"]) if evaluated else 0
        writer.writerow(["step", "tau", "tau_ci95"] + [f"acc_slot{k + 1}" for k in range(slots)])
        writer.writerows([row["step"], row["tau"], row["tau_ci95"], *row["slot_accuracy"]] for row in evaluated)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in curve], [r["loss"] for r in curve], lw=0.8)
    left.set(xlabel="step", ylabel="decayed CE loss", title="training loss")
    if evaluated:
        steps = [r["step"] for r in evaluated]
        taus = [r["tau"] for r in evaluated]
        ci = [r["tau_ci95"] for r in evaluated]
        right.errorbar(steps, taus, yerr=ci, marker="o", capsize=3)
    right.set(xlabel="step", ylabel="held-out teacher-forced tau", title="acceptance length (95% CI)")
    figure.tight_layout()
    figure.savefig(plots_dir / "train.png", dpi=110)
    plt.close(figure)


@click.command()
@click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml", show_default=True)
@click.option("--hidden", "hidden_dir", type=click.Path(path_type=Path), default="data/hidden", show_default=True)
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default="data/checkpoints", show_default=True)
@click.option("--metrics", "metrics_path", type=click.Path(path_type=Path), default="data/metrics/train.json", show_default=True)
@click.option("--plots", "plots_dir", type=click.Path(path_type=Path), default="data/plots", show_default=True)
@click.option("--device", default=None, help="cpu or cuda; default: cuda when available.")
@one_line_errors
def main(params_path, hidden_dir, target_json, out_dir, metrics_path, plots_dir, device):
    """Train the drafter; checkpoints go to OUT/step_NNNNNN, metrics and curves beside."""
    offline_by_default()
    from dflash_pipeline.config import load_params
    from dflash_pipeline.target import TargetInfo
    from dflash_pipeline.train import run_train

    config = load_params(params_path).train
    target = TargetInfo.from_json(target_json)
    result = run_train(config, target=target, train_dir=hidden_dir / "train", val_dir=hidden_dir / "val",
                       out_dir=out_dir, device=device or default_device())
    if int(os.environ.get("RANK", "0")) != 0:
        return
    curve = result.pop("curve")
    write_curves(curve, plots_dir)
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    flat = {key: value for key, value in result.items() if not isinstance(value, list)}
    flat.update({f"slot{k + 1}_acc": a for k, a in enumerate((result.get("slot_accuracy") or [])[:4])})
    metrics_path.write_text(json.dumps(flat, indent=2, sort_keys=True) + "\n")
    click.echo(f"train: step {result['steps']}, loss {result['loss']}, held-out teacher-forced tau {result['tau_tf']} "
               f"+- {result['tau_tf_ci95']}, {result['tokens_per_s']} context tokens/s")


if __name__ == "__main__":
    main()
