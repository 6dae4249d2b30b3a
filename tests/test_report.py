"""Reported files: metrics JSON stays strict JSON whatever the numbers."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_pipeline.report import flat_metrics, write_metrics


def test_eval_metrics_with_missing_values_are_strict_json_with_null(tmp_path):
    # A tiny run leaves slots no block reached (NaN) and an interval over one prompt; a bare NaN
    # in eval.json breaks jq, JavaScript and some DVC versions' metrics diff.
    best = {"name": "step_000004", "kind": "checkpoint", "step": 4, "tau": 1.25, "tau_ci95": float("nan"), "slot1_acc": 0.5,
            "slot3_acc": float("nan"), "slot3_acc_cond": np.float32("nan"), "e2e_tau": float("inf"), "blocks": 12}
    baseline = {"name": "other", "kind": "baseline", "tau": float("-inf"), "tau_ci95": 0.1}
    result = SimpleNamespace(best=best, categories=["code"], teacher_forced_seconds=float("nan"), rows=[best, baseline])
    path = tmp_path / "metrics" / "eval.json"
    write_metrics(path, flat_metrics(result, tree_budgets=[8]))
    metrics = json.loads(path.read_text(), parse_constant=lambda constant: pytest.fail(f"{path} holds a bare {constant}"))
    assert metrics["slot3_acc"] is None and metrics["slot3_acc_cond"] is None and metrics["tau_ci95"] is None
    assert metrics["e2e_tau"] is None and metrics["teacher_forced_seconds"] is None and metrics["baselines"]["other"]["tau"] is None
    assert (metrics["tau"], metrics["slot1_acc"], metrics["blocks"], metrics["chosen"]) == (1.25, 0.5, 12, "step_000004")
