"""`dvc plots diff` drawn offline: DVC's plot data of some revisions (every stage's plots, train's
curves and evaluate's), read as JSON and drawn to PNGs with one line per revision, for comparing
experiments where DVC's own HTML (chart scripts from a CDN) stays blank.

    read_plots_diff    `dvc plots diff --json REVISIONS`, parsed
    render_plots_diff  one PNG per vega plot of that output
"""

import json
import subprocess
import sys
from pathlib import Path

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import pyplot


def read_plots_diff(revisions: list[str] | tuple[str, ...]) -> dict:
    """`dvc plots diff --json REVISIONS` run here (git revisions, tags and `dvc exp` names all
    work; none: the workspace against HEAD), parsed; DVC's failure is one line."""
    command = [sys.executable, "-m", "dvc", "plots", "diff", "--json", *revisions]
    result = subprocess.run(command, capture_output=True, text=True)
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise PipelineError(f"dvc plots diff {' '.join(revisions)}: {detail}") from None


def _xy_fields(spec) -> tuple[str | None, str | None]:
    """The x and y fields of a DVC vega-lite plot spec (its first plain, non-aggregated encodings)."""
    found = {"x": None, "y": None}

    def walk(node):
        if isinstance(node, dict):
            encoding = node.get("encoding")
            if isinstance(encoding, dict):
                for axis in ("x", "y"):
                    channel = encoding.get(axis)
                    if found[axis] is None and isinstance(channel, dict) and "field" in channel and "aggregate" not in channel:
                        found[axis] = channel["field"]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    return found["x"], found["y"]


def render_plots_diff(payload: dict, out_dir: Path) -> list[Path]:
    """PNGs of `dvc plots diff --json` output: one per plot, one line per revision."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plots in sorted((payload.get("data") or {}).items()):
        for plot in plots:
            if plot.get("type") != "vega":
                continue  # image plots (our PNGs) are already pictures
            spec = plot["content"]
            x_field, y_field = _xy_fields(spec)
            values = spec.get("data", {}).get("values", [])
            if not values or x_field is None or y_field is None:
                continue
            figure, axis = plt.subplots(figsize=(6, 4))
            for revision in dict.fromkeys(row.get("rev") for row in values):
                rows = [row for row in values if row.get("rev") == revision and row.get(y_field) not in (None, "")]
                axis.plot([float(r[x_field]) for r in rows], [float(r[y_field]) for r in rows], marker=".", label=str(revision))
            axis.set(xlabel=x_field, ylabel=y_field, title=name)
            axis.legend(fontsize=8)
            figure.tight_layout()
            path = out_dir / (name.replace("/", "_").rsplit(".", 1)[0] + ".png")
            figure.savefig(path, dpi=110)
            plt.close(figure)
            written.append(path)
    return written
