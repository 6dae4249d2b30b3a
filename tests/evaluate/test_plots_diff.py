"""plots_diff.py: `dvc plots diff --json` output drawn to PNGs offline (one per vega plot, one line
per revision), and DVC's failure as one line."""

import subprocess
from types import SimpleNamespace

import pytest

from dflash_pipeline.evaluate import plots_diff
from dflash_pipeline.evaluate.plots_diff import _xy_fields, read_plots_diff, render_plots_diff
from dflash_pipeline.foundation.errors import PipelineError


def curve_plot(values: list[dict]) -> dict:
    """A vega plot as DVC 3 writes one: the data inline, the plain encodings in a layer beside an aggregated rule."""
    return {"type": "vega", "revisions": sorted({row["rev"] for row in values}),
            "content": {"data": {"values": values},
                        "layer": [{"encoding": {"x": {"aggregate": "max", "field": "rev"}, "y": {"aggregate": "max", "field": "step"}}},
                                  {"encoding": {"x": {"field": "step", "type": "quantitative"},
                                                "y": {"field": "loss", "type": "quantitative"}, "color": {"field": "rev"}}}]}}


def test_the_axes_are_the_first_plain_encodings():
    assert _xy_fields(curve_plot([])["content"]) == ("step", "loss")
    assert _xy_fields({"encoding": {"x": {"field": "a"}}}) == ("a", None)


def test_each_vega_plot_becomes_one_png_with_a_line_per_revision(tmp_path):
    values = [{"rev": rev, "step": step, "loss": loss} for rev in ("HEAD", "workspace")
              for step, loss in ((1, 3.0), (2, 2.5 if rev == "HEAD" else ""), (3, 2.0))]  # a blank cell is left out
    payload = {"data": {"data/plots/train/curve.csv": [curve_plot(values)],
                        "data/eval/plots/eval_tau.png": [{"type": "image", "url": "x.png"}],  # already a picture
                        "data/plots/empty.csv": [curve_plot([])]}}
    written = render_plots_diff(payload, tmp_path / "diff")
    assert written == [tmp_path / "diff" / "data_plots_train_curve.png"]
    assert written[0].read_bytes().startswith(b"\x89PNG") and sorted(p.name for p in (tmp_path / "diff").iterdir()) == [written[0].name]
    assert render_plots_diff({"data": None}, tmp_path / "none") == []


def test_dvc_failing_is_one_line_naming_the_revisions(monkeypatch):
    ran = []

    def fake_run(command, **kwargs):
        ran.append(command)
        return SimpleNamespace(stdout="", stderr="Traceback ...\nERROR: unknown revision 'nope'\n", returncode=1)

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(PipelineError, match=r"^dvc plots diff nope HEAD: ERROR: unknown revision 'nope'$"):
        read_plots_diff(("nope", "HEAD"))
    assert ran[0][-5:] == ["plots", "diff", "--json", "nope", "HEAD"]
    monkeypatch.setattr(plots_diff.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout='{"data": {}}', stderr=""))
    assert read_plots_diff(()) == {"data": {}}
