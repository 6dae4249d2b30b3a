"""`dvc exp run -S launch.processes=2`: dvc.yaml's generate, capture and train commands go through
stages/launch.py, which starts torchrun (gloo on this CPU), and the run makes the same answers,
the same shards and the same training curve as one process."""

import json
import sys

import pytest
import yaml
from support.helpers import REPO_ROOT, run

pytestmark = [pytest.mark.slow, pytest.mark.dvc]  # test lanes (pyproject.toml)

sys.path.insert(0, str(REPO_ROOT / "stages"))
import launch  # noqa: E402  (stages/ is a folder of scripts, not a package)


def dvc(repo, *args):
    return run([sys.executable, "-m", "dvc", *args], repo)


def _outs(repo) -> dict[str, str]:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {out["path"]: out["md5"] for stage in lock.values() for out in stage.get("outs", [])}


def test_an_experiment_with_two_processes_runs_the_stages_under_torchrun_with_the_same_results(reproduced_tiny_pipeline):
    repo = reproduced_tiny_pipeline  # one process's run, committed
    before, loss_before = _outs(repo), json.loads((repo / "data" / "metrics" / "train.json").read_text())["loss"]
    tau_before = json.loads((repo / "data" / "metrics" / "eval.json").read_text())["teacher_forced"]["tau"]

    experiment = dvc(repo, "exp", "run", "-S", "launch.processes=2")
    for stage in ("generate", "capture", "train"):  # their commands name the process count
        assert f"Running stage '{stage}'" in experiment.stdout
        assert f"stages/launch.py --processes 2 stages/{stage}.py" in experiment.stdout
    assert "Running stage 'target'" not in experiment.stdout
    assert json.loads((repo / "data" / "metrics" / "generate.json").read_text())["processes"] == 2
    after = _outs(repo)
    assert after["data/generated"] == before["data/generated"]  # the same answers, byte for byte
    assert after["data/hidden"] == before["data/hidden"]  # the same shards
    assert json.loads((repo / "data" / "metrics" / "train.json").read_text())["loss"] == pytest.approx(loss_before, rel=1e-4)
    assert json.loads((repo / "data" / "metrics" / "eval.json").read_text())["teacher_forced"]["tau"] == pytest.approx(tau_before, rel=1e-3)


def test_the_launcher_runs_one_process_itself_and_several_under_torchrun():
    assert launch.command(1, "stages/generate.py", ["--x", "1"]) == [sys.executable, "stages/generate.py", "--x", "1"]
    assert launch.command(8, "stages/train.py", []) == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc_per_node", "8", "stages/train.py"]


@pytest.mark.parametrize("argv, message", [
    (["--processes", "0", "stages/generate.py"], "key 'launch.processes' must be >= 1, got 0"),
    (["--processes", "two", "stages/generate.py"], "key 'launch.processes' must be a whole number >= 1, got 'two'"),
    (["--processes", "1", "stages/nothing.py"], "stages/nothing.py: no such stage script"),
    (["stages/generate.py"], "usage: python stages/launch.py"),
])
def test_a_bad_launch_is_one_line(argv, message):
    result = run([sys.executable, str(REPO_ROOT / "stages" / "launch.py"), *argv], REPO_ROOT, check=False)
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr
