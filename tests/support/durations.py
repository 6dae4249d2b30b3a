"""The suite's record of its own time: with `DFLASH_TEST_DURATIONS=path`, the session writes how many
tests ran, how they ended, the wall time, the machine, and the 30 slowest tests (setup, call and
teardown together, as `pytest --durations` counts them) to a JSON file. `make test-record` commits
it as tests/durations.json, which docs/results.md renders and the README's count is checked against."""

import json
import os
import platform
import time
from datetime import date
from pathlib import Path

SLOWEST = 30


class DurationsRecord:
    """A pytest plugin: per-test seconds and outcomes, written at the session's end."""

    def __init__(self, path: Path):
        self.path = path
        self.started = time.time()
        self.seconds: dict[str, float] = {}
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        nodeid = report.nodeid
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration
        if report.failed:  # a failed setup or teardown is an error, a failed call a failure; either outlasts a pass
            if self.outcomes.get(nodeid) not in ("failed", "error"):
                self.outcomes[nodeid] = "failed" if report.when == "call" else "error"
        elif report.skipped:
            self.outcomes.setdefault(nodeid, "skipped")
        elif report.when == "call":
            self.outcomes.setdefault(nodeid, "passed")

    def pytest_sessionfinish(self, session, exitstatus):
        counts = {"passed": 0, "skipped": 0, "failed": 0, "error": 0}
        for outcome in self.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        slowest = sorted(self.seconds.items(), key=lambda item: -item[1])[:SLOWEST]
        record = {
            "date": date.today().isoformat(),
            "machine": _machine(),
            "tests": len(self.outcomes),
            "outcomes": counts,
            "exit_status": int(exitstatus),
            "seconds": round(time.time() - self.started, 1),
            "slowest": [{"rank": rank, "test": nodeid, "seconds": round(seconds, 1)} for rank, (nodeid, seconds) in enumerate(slowest, 1)],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=1) + "\n")


def _machine() -> str:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores, {model}"


def register(config) -> None:
    """Record this session's durations when DFLASH_TEST_DURATIONS names a file (on the controlling process only)."""
    path = os.environ.get("DFLASH_TEST_DURATIONS")
    if path and not hasattr(config, "workerinput"):  # a pytest-xdist worker: its reports reach the controller
        config.pluginmanager.register(DurationsRecord(Path(path)), "dflash-durations-record")
