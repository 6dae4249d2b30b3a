"""DVC stage `evaluate`: score checkpoints and baseline drafters; choose the best for export.

    python stages/evaluate.py --params params.yaml --hidden data/hidden --generated data/generated \
        --target data/target/target.json --checkpoints data/checkpoints --out data/eval \
        --metrics data/metrics/eval.json --plots data/plots
"""

from pathlib import Path

import click

from dflash_pipeline.runtime import OneLineCommand, device_option, offline_by_default, one_line_errors


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
    from dflash_pipeline.config import load_params
    from dflash_pipeline.evaluate.report import summary_table, write_outputs
    from dflash_pipeline.evaluate.run import describe_best_mode, run_evaluate
    from dflash_pipeline.stats import format_interval
    from dflash_pipeline.target.load import TargetInfo

    config = load_params(params_path).evaluate
    target = TargetInfo.from_json(target_json)
    result = run_evaluate(config, target=target, hidden_val_dir=hidden_dir / "val", generated_val=generated_dir / "val.parquet",
                          checkpoints_dir=checkpoints_dir, device=device, log=click.echo, source=str(params_path))
    write_outputs(result, out_dir=out_dir, metrics_path=metrics_path, plots_dir=plots_dir)
    evaluation = result.record
    click.echo(summary_table(evaluation))
    chosen = evaluation.chosen_record
    scored, decoding = chosen.teacher_forced, chosen.decoding
    line = f"evaluate: chosen {chosen.name} (teacher-forced tau {format_interval(scored.tau.mean, scored.tau.ci95, digits=4)})"
    if decoding is not None:
        chain = decoding.chain
        line += (f"; end-to-end tau {chain.tau.mean}, speedup {chain.speedup} (break-even tau on this machine {chain.break_even_tau}), "
                 f"lossless rate {chain.lossless_rate}")
    click.echo(line)
    if decoding is not None and decoding.best is not None:
        click.echo(f"evaluate: chosen {chosen.name}: {describe_best_mode(decoding.best)} on {decoding.best.machine}")
    if decoding is not None and (decoding.trees or decoding.sampled):
        trees = [f"{budget}: tau {run.tau.mean}, speedup {run.speedup}, verify cost {run.verify_cost_steps} steps"
                 for budget, run in decoding.trees.items()]
        sampled = [f"T={temperature:g}: tau {run.tau.mean}, speedup {run.speedup}" for temperature, run in decoding.sampled.items()]
        click.echo("evaluate: trees at budget " + "; ".join(trees) + (" | sampled at " + "; ".join(sampled) if sampled else ""))


if __name__ == "__main__":
    main()
