"""cli/plots.py: `dflash-pipeline plots` prints the PNGs it drew and DVC's per-revision errors, and
is one error line when there is nothing to draw (DVC's own output is stubbed: tests/evaluate/test_plots_diff.py
draws real payloads)."""

from support.console import assert_one_line_error, invoke

from dflash_pipeline.evaluate import plots_diff


def test_plots_draws_what_dvc_returns_and_passes_on_its_errors(tmp_path, monkeypatch):
    values = [{"rev": rev, "step": step, "tau": 1 + step / 10} for rev in ("main", "exp-1a2b3") for step in (1, 2)]
    payload = {"data": {"data/plots/eval/tau.csv": [{"type": "vega", "content": {
        "data": {"values": values}, "encoding": {"x": {"field": "step"}, "y": {"field": "tau"}}}}]},
        "errors": [{"rev": "exp-1a2b3", "name": "data/plots/train/curve.csv", "msg": "missing"}]}
    asked = []
    monkeypatch.setattr(plots_diff, "read_plots_diff", lambda revisions: asked.append(revisions) or payload)
    result = invoke("plots", "main", "exp-1a2b3", "--out", tmp_path / "diff")
    assert result.exit_code == 0 and asked == [("main", "exp-1a2b3")], result.output
    assert result.stdout == f"plots: wrote {tmp_path / 'diff' / 'data_plots_eval_tau.png'}\n"
    assert result.stderr == "plots: exp-1a2b3: data/plots/train/curve.csv: missing\n"

    monkeypatch.setattr(plots_diff, "read_plots_diff", lambda revisions: {"data": {}})
    assert_one_line_error(invoke("plots", "HEAD", "--out", tmp_path / "none"), "dvc plots diff HEAD: no plot data to draw")
