"""The test lanes' guard. `make test-fast` deselects the markers `slow`, `dvc` and `subprocess`
(pyproject.toml). A test that drives DVC or spawns a process through the shared helpers without its
marker would slip into the fast lane, so it fails, naming the marker. tests/conftest.py's hooks
record the running test here; one copy of this module (`support.lanes`) holds that state.
"""

from pathlib import Path

import pytest

# `make test-fast` deselects the markers `slow`, `dvc` and `subprocess` (pyproject.toml). A test that
# drives DVC or spawns a process through the helpers below without its marker would slip into the
# fast lane, so it fails, naming the marker. The markers a test may carry for each:
LANE_FIXTURES = {"pipeline_repo": ("dvc",), "tiny_pipeline": ("dvc",), "reproduced_tiny_pipeline": ("dvc",),
                 "tiny_pipeline_reproduced_once": ("dvc",)}

DVC_MARKERS = ("dvc",)

SPAWN_MARKERS = ("subprocess", "dvc")  # a dvc test spawns git, dvc and the stage scripts by nature

_running: dict = {"item": None}

def require_marker(item, what: str, markers: tuple[str, ...]) -> None:
    if item is not None and not any(item.get_closest_marker(name) for name in markers):
        pytest.fail(f"{item.nodeid} {what}: mark it @pytest.mark.{markers[0]} (test lanes, tests/conftest.py)", pytrace=False)

def require_spawn_marker(cmd) -> None:
    """The running test may spawn `cmd`: a `dvc` command needs the dvc marker, any other subprocess or dvc."""
    program = Path(str(cmd[0])).name if cmd else ""
    is_dvc = program == "dvc" or [str(part) for part in cmd[1:3]] == ["-m", "dvc"]
    require_marker(_running["item"], "runs dvc" if is_dvc else f"spawns {program or 'a process'}",
                   DVC_MARKERS if is_dvc else SPAWN_MARKERS)


def check_lane_fixtures(item) -> None:
    """Before any fixture is built: a test using a DVC fixture must carry the dvc marker."""
    for fixture, markers in LANE_FIXTURES.items():
        if fixture in item.fixturenames:
            require_marker(item, f"uses the fixture {fixture}", markers)
