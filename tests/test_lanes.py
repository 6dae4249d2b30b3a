"""The test lanes' guard (tests/support/lanes.py): a test that runs dvc or spawns a process through the
shared helpers, or builds a DVC pipeline fixture, without the matching marker fails, naming it."""

from types import SimpleNamespace

import pytest
from support import lanes
from support.helpers import run, stage_env


def test_an_unmarked_test_may_not_spawn_a_process_or_run_dvc(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"spawns git: mark it @pytest.mark.subprocess"):
        run(["git", "--version"], cwd=tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"runs dvc: mark it @pytest.mark.dvc"):
        run(["dvc", "version"], cwd=tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"runs dvc: mark it @pytest.mark.dvc"):
        run(["python", "-m", "dvc", "version"], cwd=tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"\(stage_env\): mark it @pytest.mark.subprocess"):
        stage_env()


@pytest.mark.subprocess
def test_a_subprocess_test_may_spawn_but_not_run_dvc(tmp_path):
    assert run(["git", "--version"], cwd=tmp_path).stdout.startswith("git version")
    assert stage_env()["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(pytest.fail.Exception, match=r"mark it @pytest.mark.dvc"):
        run(["dvc", "version"], cwd=tmp_path)


def test_a_pipeline_fixture_needs_the_dvc_marker():
    def item(*markers):
        return SimpleNamespace(nodeid="tests/test_x.py::test_y", fixturenames=["tmp_path", "tiny_pipeline"],
                               get_closest_marker=lambda name: name if name in markers else None)

    with pytest.raises(pytest.fail.Exception, match=r"test_y uses the fixture tiny_pipeline: mark it @pytest.mark.dvc"):
        lanes.check_lane_fixtures(item())
    with pytest.raises(pytest.fail.Exception):
        lanes.check_lane_fixtures(item("subprocess"))
    lanes.check_lane_fixtures(item("dvc", "slow"))
