"""DVC stage `evaluate`: score checkpoints and baseline drafters; choose the best for export.

    python stages/evaluate.py --params params.yaml --hidden data/hidden --generated data/generated \
        --target data/target/target.json --checkpoints data/checkpoints --out data/eval \
        --metrics data/metrics/eval.json --plots data/plots
"""

from pathlib import Path

import click

from dflash_pipeline.foundation.runtime import OneLineCommand, device_option, offline_by_default, one_line_errors


@click.command(cls=OneLineCommand)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml", show_default=True)
@click.option("--hidden", "hidden_dir", type=click.Path(path_type=Path), default="data/hidden", show_default=True,
              help="Capture output; its val split is scored teacher-forced.")
@click.option("--generated", "generated_dir", type=click.Path(path_type=Path), default="data/generated", show_default=True,
              help="Generate output; val prompts for end-to-end decoding and prompt categories.")
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--checkpoints", "checkpoints_dir", type=click.Path(path_type=Path), default="data/checkpoints", show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default="data/eval", show_default=True)
@click.option("--metrics", "metrics_path", type=click.Path(path_type=Path), default="data/metrics/eval.json", show_default=True)
@click.option("--plots", "plots_dir", type=click.Path(path_type=Path), default="data/plots", show_default=True)
@device_option
@one_line_errors
def main(params_path, hidden_dir, generated_dir, target_json, checkpoints_dir, out_dir, metrics_path, plots_dir, device):
    """Score every selected checkpoint and baseline; write eval.json, the comparison and plots."""
    offline_by_default()
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.evaluate.report import console_lines, summary_table, write_outputs
    from dflash_pipeline.evaluate.run import run_evaluate
    from dflash_pipeline.target.load import TargetInfo
    from dflash_pipeline.target.placement import TargetPlacement

    params = load_params(params_path)
    target = TargetInfo.from_json(target_json)
    result = run_evaluate(params.evaluate, target=target, hidden_val_dir=hidden_dir / "val", generated_val=generated_dir / "val.parquet",
                          checkpoints_dir=checkpoints_dir, device=device, log=click.echo, source=str(params_path),
                          placement=TargetPlacement.from_params(params, str(params_path)))
    write_outputs(result, out_dir=out_dir, metrics_path=metrics_path, plots_dir=plots_dir)
    click.echo(summary_table(result.record))
    for line in console_lines(result.record):
        click.echo(line)


if __name__ == "__main__":
    main()
