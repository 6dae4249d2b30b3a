"""train/report.py: train.json from the typed record (`to_metrics`: the committed file's keys, and
the values the untyped dict before it gave for the same run) and the training curves."""

import json

import pytest
import yaml
from support.helpers import REPO_ROOT
from support.stage_commands import train_tiny_run

from dflash_pipeline.measure.record import Interval
from dflash_pipeline.train.record import HeldOutTau, TrainRecord
from dflash_pipeline.train.report import to_metrics, write_train_outputs

COMMITTED_METRICS = REPO_ROOT / "data" / "metrics" / "train.json"


def _record(slots: int, **changes) -> TrainRecord:
    held_out = HeldOutTau(step=6, tau=Interval(1.75, 0.125), slot_accuracy=[0.5 - 0.1 * k for k in range(slots)])
    fields = dict(steps=6, resumed_from=0, last_checkpoint=6, loss=2.5, held_out=held_out, tokens_per_s=1234.5, seconds=0.75,
                  mask_token_id=0, curve=[{"step": 6, "loss": 2.5, "slot1_acc": 0.5}])
    return TrainRecord(**{**fields, **changes})


def test_the_metrics_keys_are_the_committed_train_json_keys():
    # params.yaml's block size gives train.json its slot keys (slots 1..B-1, at most 4 of them).
    block_size = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["train"]["block_size"]
    committed = json.loads(COMMITTED_METRICS.read_text())
    metrics = to_metrics(_record(block_size - 1))
    assert set(metrics) == set(committed)
    assert all(type(metrics[key]) is type(value) for key, value in committed.items()), (metrics, committed)


def test_the_metrics_name_the_first_four_slots_and_the_held_out_interval():
    metrics = to_metrics(_record(15))
    assert [key for key in metrics if key.startswith("slot")] == ["slot1_acc", "slot2_acc", "slot3_acc", "slot4_acc"]
    assert metrics["slot4_acc"] == pytest.approx(0.2) and (metrics["tau_tf"], metrics["tau_tf_ci95"]) == (1.75, 0.125)
    assert "curve" not in metrics and "slot_accuracy" not in metrics  # lists stay out of the flat file
    unvalidated = to_metrics(_record(3, held_out=None))
    assert (unvalidated["tau_tf"], unvalidated["tau_tf_ci95"]) == (None, None) and "slot1_acc" not in unvalidated


def _metrics_before_the_typed_record(run) -> dict:
    """train.json's dict as the code before the typed record built it from a finished run:
    `_final_metrics` of d075ee0:src/dflash_pipeline/train/run.py and `write_train_outputs` of d075ee0:src/dflash_pipeline/train/report.py, verbatim
    but for the names. The reference the record must reproduce."""
    def mean(values):
        return round(sum(values) / len(values), 6) if values else None

    final = next((row for row in reversed(run.curve) if "tau" in row), {})
    result = {
        "steps": run.config.max_steps,
        "resumed_from": run.start_step,
        "last_checkpoint": run.last_saved,
        "loss": mean(run.recent_losses),
        "tau_tf": final.get("tau"),
        "tau_tf_ci95": final.get("tau_ci95"),
        "slot_accuracy": final.get("slot_accuracy"),
        "tokens_per_s": round(run.tokens_seen / run.seconds, 1) if run.seconds > 0 and run.tokens_seen else None,
        "seconds": round(run.seconds, 3),
        "curve": run.curve,
        "mask_token_id": run.mask_token_id,
    }
    flat = {key: value for key, value in result.items() if not isinstance(value, list)}
    flat.update({f"slot{k + 1}_acc": a for k, a in enumerate((result.get("slot_accuracy") or [])[:4])})
    return flat


def test_train_json_holds_what_the_untyped_dict_held_for_the_same_run(tiny_run, tmp_path, monkeypatch):
    # Golden: one tiny run, then its rerun (resumed at its last step, reported from the saved
    # state); each run's state as the loop left it gives the old dict, its record the new one.
    import dflash_pipeline.train.run as train_run

    runs = []
    final_record = train_run.final_record
    monkeypatch.setattr(train_run, "final_record", lambda run: runs.append(run) or final_record(run))
    for name in ("first", "rerun"):
        record = train_tiny_run(tiny_run, tmp_path / "ck")
        metrics = write_train_outputs(record, metrics_path=tmp_path / f"{name}.json", plots_dir=tmp_path / "plots")
        expected = _metrics_before_the_typed_record(runs[-1])
        assert json.dumps(metrics, sort_keys=True) == json.dumps(expected, sort_keys=True), name  # NaN-safe and type-exact
        assert json.loads((tmp_path / f"{name}.json").read_text()) == json.loads(json.dumps(expected))
        assert set(metrics) == set(json.loads(COMMITTED_METRICS.read_text()))  # the tiny run's block is params.yaml's too
    assert [run.start_step for run in runs] == [0, 6]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # matplotlib, drawing the infinite interval
def test_the_training_curves_leave_an_undefined_interval_empty(tmp_path):
    # One val prompt: the periodic tau has no interval (infinite in memory); train_tau.csv wrote `inf`,
    # which `dvc plots` and pandas read as a number, while train.json had null.
    curve = [{"step": 1, "loss": 2.5, "slot1_acc": 0.1},
             {"step": 2, "loss": 2.25, "slot1_acc": float("nan"), "tau": 1.5, "tau_ci95": float("inf"), "slot_accuracy": [0.25, float("nan")]}]
    record = TrainRecord(steps=2, resumed_from=0, last_checkpoint=2, loss=2.25,
                         held_out=HeldOutTau(step=2, tau=Interval(1.5, float("inf")), slot_accuracy=[0.25, float("nan")]),
                         tokens_per_s=None, seconds=0.5, mask_token_id=0, curve=curve)
    metrics = write_train_outputs(record, metrics_path=tmp_path / "train.json", plots_dir=tmp_path / "plots")
    assert json.loads((tmp_path / "train.json").read_text())["tau_tf_ci95"] is None and metrics["slot2_acc"] != metrics["slot2_acc"]
    assert (tmp_path / "plots" / "train_tau.csv").read_text() == "step,tau,tau_ci95,acc_slot1,acc_slot2\n2,1.5,,0.25,\n"
    assert (tmp_path / "plots" / "train_loss.csv").read_text() == "step,loss,slot1_acc\n1,2.5,0.1\n2,2.25,\n"
