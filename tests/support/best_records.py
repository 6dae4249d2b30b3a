"""Evaluate's best.json and its `best_mode` section written by hand, laid out as a pipeline run lays
them out, for the tests that read the record back (`evaluate.recorded_mode`, `dflash-pipeline decode`)."""

import json
import shutil
from pathlib import Path

EPYC = "cpu on AMD EPYC 7B13, 2 CPUs"


def tree4_record(**changes) -> dict:
    """best.json's `best_mode` of a drafter whose DDTree of 4 paid and whose chain did not (the issue's EPYC)."""
    return {"mode": "tree4", "speedup": 1.08, "tau": 1.81, "tau_ci95": 0.2, "lossless_rate": 1.0, "verify_tokens": None, "tree_budget": 4,
            "speedups": {"chain": 0.97, "tree4": 1.08, "tree8": 1.02}, "refused": {}, "machine": EPYC, **changes}


def pipeline_run(root: Path, checkpoint: Path | None = None, **best) -> Path:
    """A pipeline's data/ layout: data/checkpoints/step_000004 (a copy of `checkpoint`, else an empty
    folder) and evaluate's data/eval/best.json choosing it by the relative path the stage writes."""
    step = root / "data" / "checkpoints" / "step_000004"
    if checkpoint is not None:
        shutil.copytree(checkpoint, step)
    else:
        step.mkdir(parents=True)
    (root / "data" / "eval").mkdir(parents=True)
    record = {"name": "step_000004", "kind": "checkpoint", "step": 4, "path": "data/checkpoints/step_000004", "tau": 1.5, "tau_ci95": 0.1,
              "chosen_by": "teacher-forced tau", **best}
    (root / "data" / "eval" / "best.json").write_text(json.dumps(record))
    return step
