"""DVC stage `train`: train (or resume) the DFlash drafter on the captured shards.

    python stages/train.py --params params.yaml --hidden data/hidden --target data/target/target.json \
        --out data/checkpoints --metrics data/metrics/train.json --plots data/plots
    torchrun --nproc_per_node 8 stages/train.py ...   # data parallel over GPUs (or gloo on CPU)
"""

import os
from pathlib import Path

import click

from dflash_pipeline.foundation.runtime import OneLineCommand, device_option, offline_by_default, one_line_errors


@click.command(cls=OneLineCommand)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml", show_default=True)
@click.option("--hidden", "hidden_dir", type=click.Path(path_type=Path), default="data/hidden", show_default=True)
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default="data/checkpoints", show_default=True)
@click.option("--metrics", "metrics_path", type=click.Path(path_type=Path), default="data/metrics/train.json", show_default=True)
@click.option("--plots", "plots_dir", type=click.Path(path_type=Path), default="data/plots", show_default=True)
@device_option
@one_line_errors
def main(params_path, hidden_dir, target_json, out_dir, metrics_path, plots_dir, device):
    """Train the drafter; checkpoints go to OUT/step_NNNNNN, metrics and curves beside."""
    offline_by_default()
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.foundation.stats import format_interval
    from dflash_pipeline.target.load import TargetInfo
    from dflash_pipeline.train.report import write_train_outputs
    from dflash_pipeline.train.run import run_train

    config = load_params(params_path).train
    target = TargetInfo.from_json(target_json)
    record = run_train(config, target=target, train_dir=hidden_dir / "train", val_dir=hidden_dir / "val",
                       out_dir=out_dir, device=device, source=str(params_path))
    if int(os.environ.get("RANK", "0")) != 0:
        return
    metrics = write_train_outputs(record, metrics_path=metrics_path, plots_dir=plots_dir)
    click.echo(f"train: step {metrics['steps']}, loss {metrics['loss']}, held-out teacher-forced tau "
               f"{format_interval(metrics['tau_tf'], metrics['tau_tf_ci95'], digits=4)}, {metrics['tokens_per_s']} context tokens/s")


if __name__ == "__main__":
    main()
