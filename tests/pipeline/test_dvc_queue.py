"""A parameter sweep as a team runs one: `dvc exp run --queue` per point, then `dvc queue start -j N`.

Queued experiments run in temporary copies of the committed repo, by background workers, so what
they need must be committed (params, prompts, dvc.lock) or cached (the outputs they reuse), and
they must run offline. The uncached `target` output is rebuilt in each copy (seconds).
"""

import json
import time

import pytest
from support.helpers import run

pytestmark = [pytest.mark.slow, pytest.mark.dvc]  # test lanes (pyproject.toml)


def dvc(repo, *args):
    return run(["dvc", *args], cwd=repo)


def experiments_by_name(repo) -> dict[str, dict]:
    """`dvc exp show --json` as {experiment name: its data (rev, params, metrics)}, baseline excluded."""
    shown = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    found = {}
    for baseline in shown:
        for experiment in baseline.get("experiments") or []:
            for rev in experiment["revs"]:
                found[rev["name"]] = rev
    return found


def queue_is_done(repo) -> bool:
    status = dvc(repo, "queue", "status").stdout
    return not any(word in status for word in ("Queued", "Running"))


def test_two_queued_experiments_run_and_both_show_params_and_metrics(reproduced_tiny_pipeline):
    repo = reproduced_tiny_pipeline  # the baseline run, committed
    baseline_loss = json.loads((repo / "data" / "metrics" / "train.json").read_text())["loss"]

    sweep = {"lr-high": "0.01", "lr-low": "0.0005"}
    for name, lr in sweep.items():
        dvc(repo, "exp", "run", "--queue", "--name", name, "-S", f"train.lr={lr}")
    assert all(name in dvc(repo, "queue", "status").stdout for name in sweep)

    dvc(repo, "queue", "start", "-j", "1")
    deadline = time.time() + 300
    while not queue_is_done(repo):
        assert time.time() < deadline, dvc(repo, "queue", "status").stdout
        time.sleep(5)  # each `dvc queue status` costs a second of CPU the workers need
    status = dvc(repo, "queue", "status").stdout
    assert "Failed" not in status, status + "\n".join(dvc(repo, "queue", "logs", name).stdout for name in sweep)

    shown = experiments_by_name(repo)
    assert set(sweep) <= set(shown), shown.keys()
    losses = {}
    for name, lr in sweep.items():
        data = shown[name]["data"]
        assert data["params"]["params.yaml"]["data"]["train"]["lr"] == float(lr)
        train_metrics = data["metrics"]["data/metrics/train.json"]["data"]
        eval_metrics = data["metrics"]["data/metrics/eval.json"]["data"]
        assert eval_metrics["chain"]["lossless_rate"] == 1.0 and eval_metrics["teacher_forced"]["tau"] >= 1.0
        losses[name] = train_metrics["loss"]
    # Each point trained with its own learning rate: two distinct losses, both unlike the baseline's.
    assert len({baseline_loss, *losses.values()}) == 3, (baseline_loss, losses)
    # The workspace is still the baseline: queued runs never touch it.
    assert json.loads((repo / "data" / "metrics" / "train.json").read_text())["loss"] == baseline_loss
