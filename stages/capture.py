"""DVC stage `capture`: target hidden states of every generated sequence into Arrow shards.

    python stages/capture.py --params params.yaml --generated data/generated \
        --target data/target/target.json --out data/hidden --metrics data/metrics/capture.json
    python stages/launch.py --processes 8 stages/capture.py ...   # torchrun, 8 GPUs: each rank its own shards

OUT/summary.json holds only what the shards hold; this run's timings go to the metrics file, so a
rerun that changes no shard leaves OUT byte for byte as it was (and train is not rerun).
"""

from pathlib import Path

import click

from dflash_pipeline.foundation.runtime import OneLineCommand, device_option, offline_by_default, one_line_errors


@click.command(cls=OneLineCommand)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml", show_default=True)
@click.option("--generated", "generated_dir", type=click.Path(path_type=Path), default="data/generated", show_default=True)
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default="data/hidden", show_default=True)
@click.option("--metrics", "metrics_path", type=click.Path(path_type=Path), default="data/metrics/capture.json", show_default=True,
              help="This run's timings and shards written (kept out of OUT).")
@device_option
@one_line_errors
def main(params_path: Path, generated_dir: Path, target_json: Path, out_dir: Path, metrics_path: Path, device: str) -> None:
    """Capture the selected target layers for the train and val splits into OUT/{train,val}/."""
    offline_by_default()
    from dflash_pipeline.capture.run import run_capture
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.foundation.files import write_json_atomic, write_metrics
    from dflash_pipeline.target.load import TargetInfo
    from dflash_pipeline.target.placement import TargetPlacement

    params = load_params(params_path)
    target = TargetInfo.from_json(target_json)
    summary = run_capture(params.capture, target=target, generated_dir=generated_dir, out_dir=out_dir, device=device,
                          source=str(params_path), placement=TargetPlacement.from_params(params, str(params_path)))
    if summary["splits"]:
        this_run = summary.pop("this_run")
        write_json_atomic(out_dir / "summary.json", summary)
        write_metrics(metrics_path, this_run)
        for split, info in summary["splits"].items():
            click.echo(
                f"capture {split}: {info['sequences']} sequences, {info['tokens']:,} tokens "
                f"({info['loss_tokens']:,} answer), {info['shards']} shard(s), {info['bytes'] / 2**20:.1f} MiB; {info['stats']}; "
                f"{this_run[split]['shards_written']} shard(s) written in {this_run[split]['seconds']} s"
            )


if __name__ == "__main__":
    main()
