"""`dflash-pipeline compare-runs`: the chosen drafters of two evaluate outputs compared, paired by
val prompt (`evaluate.compare.compare_eval_runs`)."""

import click

from dflash_pipeline.cli.group import EXISTING_DIR, main
from dflash_pipeline.foundation.runtime import one_line_errors


@main.command("compare-runs", short_help="Compare two runs' chosen drafters, paired by val prompt.")
@click.argument("run_a", type=EXISTING_DIR)
@click.argument("run_b", type=EXISTING_DIR)
@one_line_errors
def compare_runs(run_a, run_b):
    """Compare the chosen drafters of two evaluate outputs (each run's data/eval folder), e.g. the
    committed run against a recomputation on another machine: τ of each, their difference paired
    over the val prompts both scored, and whether 95% tells them apart.

    \b
    Example:
      dflash-pipeline compare-runs data/eval ../other-clone/data/eval
    """
    from dflash_pipeline.evaluate.compare import compare_eval_runs

    result = compare_eval_runs(run_a, run_b)
    blocks = "the same val blocks" if result.same_blocks else "different val blocks (the runs' answers differ)"
    click.echo(f"tau {result.tau_a:.4f} vs {result.tau_b:.4f} on {blocks}")
    click.echo(result.verdict)
