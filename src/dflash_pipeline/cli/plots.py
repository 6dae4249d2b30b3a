"""`dflash-pipeline plots`: `dvc plots diff` of some revisions drawn to PNG files offline
(`evaluate.plots_diff`)."""

from pathlib import Path

import click

from dflash_pipeline.cli.group import main
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.runtime import one_line_errors


@main.command(short_help="Draw `dvc plots diff` of revisions to PNGs (offline).")
@click.argument("revisions", nargs=-1)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default="data/plots/diff", show_default=True)
@one_line_errors
def plots(revisions, out_dir):
    """`dvc plots diff REVISIONS` drawn to PNG files, one line per revision.

    DVC's own HTML loads its chart scripts from a CDN and stays blank offline; this asks DVC for
    the same data (`dvc plots diff --json`, so git revisions, tags and `dvc exp` names all work)
    and draws it with matplotlib. Without REVISIONS: the workspace against HEAD. Run it in the
    pipeline's repository.

    \b
    Example:
      dvc exp run -S train.lr=0.001
      dflash-pipeline plots HEAD            # workspace (the experiment) vs HEAD
      dflash-pipeline plots main exp-1a2b3 --out /tmp/plots
    """
    from dflash_pipeline.evaluate.plots_diff import read_plots_diff, render_plots_diff

    payload = read_plots_diff(revisions)
    for error in payload.get("errors", []) or []:
        click.echo(f"plots: {error.get('rev')}: {error.get('name')}: {error.get('msg')}", err=True)
    written = render_plots_diff(payload, out_dir)
    if not written:
        raise PipelineError(f"dvc plots diff {' '.join(revisions)}: no plot data to draw (is this the pipeline's repository?)")
    for path in written:
        click.echo(f"plots: wrote {path}")
