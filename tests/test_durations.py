"""The suite's record of its own time (tests/support/durations.py): what `make test-record` writes, and
the README quoting the committed record's count and minutes, not a number typed once and left."""

import json
import re
import subprocess
from types import SimpleNamespace

from support.durations import SLOWEST, DurationsRecord
from support.helpers import REPO_ROOT


def report(nodeid, when, outcome, duration):
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration, failed=outcome == "failed", skipped=outcome == "skipped")


def test_the_record_counts_each_test_once_by_its_worst_phase_and_keeps_the_slowest(tmp_path):
    record = DurationsRecord(tmp_path / "durations.json")
    phases = {"a": [("setup", "passed", 1.0), ("call", "passed", 2.0), ("teardown", "passed", 0.5)],
              "b": [("setup", "passed", 0.1), ("call", "failed", 0.2), ("teardown", "passed", 0.1)],
              "c": [("setup", "skipped", 0.0)],
              "d": [("setup", "passed", 0.1), ("call", "passed", 0.1), ("teardown", "failed", 9.0)]}
    for name in [f"t{i}" for i in range(SLOWEST + 5)]:
        phases[name] = [("setup", "passed", 0.0), ("call", "passed", 0.01), ("teardown", "passed", 0.0)]
    for nodeid, reports in phases.items():
        for when, outcome, duration in reports:
            record.pytest_runtest_logreport(report(nodeid, when, outcome, duration))
    record.pytest_sessionfinish(None, 1)
    written = json.loads((tmp_path / "durations.json").read_text())
    assert written["tests"] == len(phases) and written["exit_status"] == 1
    assert written["outcomes"] == {"passed": 1 + SLOWEST + 5, "skipped": 1, "failed": 1, "error": 1}
    assert [row["test"] for row in written["slowest"][:3]] == ["d", "a", "b"] and written["slowest"][1]["seconds"] == 3.5
    assert len(written["slowest"]) == SLOWEST and [row["rank"] for row in written["slowest"]] == list(range(1, SLOWEST + 1))


def test_the_readme_quotes_the_committed_record():
    committed = subprocess.run(["git", "-C", str(REPO_ROOT), "show", "HEAD:./tests/durations.json"], capture_output=True, text=True)
    assert committed.returncode == 0, "tests/durations.json is not committed: `make test-record` on a quiet machine, then commit it"
    record = json.loads(committed.stdout)
    readme = (REPO_ROOT / "README.md").read_text()
    quoted = re.search(r"The whole suite \((\d[\d,]*) tests\) ran in ([\d.]+) min", readme)
    assert quoted, "README.md no longer says 'The whole suite (N tests) ran in M min'"
    assert int(quoted.group(1).replace(",", "")) == record["tests"], (quoted.group(0), record["tests"])
    assert float(quoted.group(2)) == round(record["seconds"] / 60, 1), (quoted.group(0), record["seconds"])
