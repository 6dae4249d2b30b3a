"""cli/evaluate.py: `dflash-pipeline evaluate` scores checkpoints and baselines side by side on the
tiny run (identical numbers for a checkpoint and its own export), and refuses bad input in one line."""

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from support.console import assert_one_line_error, invoke
from support.helpers import flip_a_byte

from dflash_pipeline.drafters.serving import PROVENANCE_FILE
from dflash_pipeline.target.load import TargetInfo


def comparable(candidate: dict) -> dict:
    """The teacher-forced numbers of one candidate of details.json (not its name, kind, path or timing)."""
    scored = {key: value for key, value in candidate["teacher_forced"].items() if key != "seconds"}
    return {"teacher_forced": scored, "tree": candidate["tree"], "vs_chosen": candidate["vs_chosen"], "extras": candidate.get("extras")}


def test_a_damaged_val_parquet_is_refused_by_evaluate_in_one_line(cli_run, tmp_path):
    # evaluate read val.parquet (prompt categories, end-to-end prompts) without a check, and the
    # command's --prompts read only its schema: a flipped bit in it was scored as if valid.
    from dflash_pipeline.evaluate.run import run_evaluate
    from dflash_pipeline.foundation.config import EvaluateConfig
    from dflash_pipeline.foundation.errors import PipelineError
    val = Path(shutil.copy(cli_run.generated / "val.parquet", tmp_path / "val.parquet"))
    # generate's record of it (`sha256sum -c` format), spelled out here
    (tmp_path / "val.parquet.sha256").write_text(f"{hashlib.sha256(val.read_bytes()).hexdigest()}  val.parquet\n")
    flip_a_byte(val)
    with pytest.raises(PipelineError) as error:
        run_evaluate(EvaluateConfig(num_prompts=1), target=TargetInfo.from_json(cli_run.target_json), hidden_val_dir=cli_run.val,
                     generated_val=val, checkpoint_folders=[cli_run.checkpoint], device="cpu", log=lambda *_: None)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{val}: damaged (sha256 ") and "val.parquet.sha256 records" in message, message
    assert_one_line_error(invoke("evaluate", cli_run.checkpoint, "--target", cli_run.target_json, "--shards", cli_run.val, "--prompts", val,
                                 "--device", "cpu"), f"{val}: damaged (sha256 ", "val.parquet.sha256 records")


def test_evaluate_a_checkpoint_against_its_own_export_gives_identical_numbers(cli_run, tmp_path):
    out = tmp_path / "eval"
    result = invoke("evaluate", cli_run.checkpoint, cli_run.export, "--target", cli_run.target_json, "--shards", cli_run.val, "--anchors", 0,
                    "--tree-budgets", "2,8", "--out", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    table = result.stdout.splitlines()
    assert any(line.split()[:3] == ["step_000004", "*", "checkpoint"] for line in table), result.stdout
    assert any(line.split()[:2] == ["export", "baseline"] for line in table), result.stdout

    rows = {row["kind"]: row for row in json.loads((out / "details.json").read_text())["candidates"]}
    ours, baseline = rows["checkpoint"], rows["baseline"]
    assert comparable(ours) == comparable(baseline)
    assert baseline["vs_chosen"]["tau"] == 0 and baseline["vs_chosen"]["tau_ci95"] == 0  # paired over prompts: exactly no difference
    assert "export vs step_000004: tau difference +0.0000 ± 0.0000" in result.stderr + result.stdout
    assert "not distinguishable at 95%" in result.stderr + result.stdout
    manifest = json.loads((cli_run.val / "manifest.json").read_text())
    assert ours["teacher_forced"]["blocks"] == manifest["loss_tokens"] - manifest["sequences"]  # --anchors 0: every answer position but the last
    assert "streak" in ours["tree"]["8"] and "chain" not in ours  # no --prompts: no end-to-end decoding
    blocks = pd.read_parquet(out / "blocks.parquet")
    by_drafter = {name: frame.drop(columns="drafter").reset_index(drop=True) for name, frame in blocks.groupby("drafter")}
    pd.testing.assert_frame_equal(by_drafter["step_000004"], by_drafter["export"])
    assert (by_drafter["export"]["tau"] > 1).any()  # the comparison is not between two all-miss drafters
    best = json.loads((out / "best.json").read_text())
    assert best["name"] == "step_000004" and (out / "eval.json").is_file() and (out / "plots" / "eval_tau.png").is_file()
    # export acts on best.json: it carries its sha256 (`sha256sum -c` format) for export to check
    assert (out / "best.json.sha256").read_text() == f"{hashlib.sha256((out / 'best.json').read_bytes()).hexdigest()}  best.json\n"
    metrics = json.loads((out / "eval.json").read_text())
    assert "vs_chosen" not in metrics and metrics["baselines"]["export"]["vs_chosen"]["tau"] == 0
    assert metrics["chosen"] == {"name": "step_000004", "step": 4} and metrics["teacher_forced"]["tau"] == best["tau"]


def test_evaluate_with_a_model_folder_target_and_val_prompts_decodes_losslessly(cli_run):
    result = invoke("evaluate", cli_run.checkpoint, "--target", cli_run.model_dir, "--shards", cli_run.hidden, "--prompts", cli_run.generated,
                    "--anchors", 4, "--e2e-prompts", 1, "--max-new-tokens", 4, "--device", "cpu")
    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()[-2:]
    values = dict(zip(header.split(), row.replace(" *", "").split()))
    assert values["name"] == "step_000004" and float(values["lossless_rate"]) == 1.0 and float(values["e2e_tau"]) >= 1.0
    assert "NOT LOSSLESS" not in result.stdout
    assert_one_line_error(invoke("evaluate", cli_run.checkpoint, "--target", cli_run.model_dir, "--shards", cli_run.hidden, "--temperatures", "1,x"),
                          "--temperatures")


def test_evaluate_bad_input_is_one_line(cli_run, tiny_qwen3_dir, tmp_path):
    common = ["--shards", cli_run.val, "--device", "cpu"]
    assert_one_line_error(invoke("evaluate", tmp_path / "nope", "--target", cli_run.target_json, *common), "does not exist")
    assert_one_line_error(invoke("evaluate", cli_run.checkpoint, "--target", tmp_path, *common), "neither a target.json")
    assert_one_line_error(invoke("evaluate", cli_run.checkpoint, "--target", cli_run.val / "manifest.json", *common), "not a target.json")
    # Another target (fingerprinted from its folder) than the one the shards were captured from.
    assert_one_line_error(invoke("evaluate", cli_run.checkpoint, "--target", tiny_qwen3_dir, *common), "manifest.json", "captured from target")
    # A drafter wired to other target layers than the shards hold.
    other = shutil.copytree(cli_run.export, tmp_path / "other-layers")
    config = json.loads((other / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 2]
    (other / "config.json").write_text(json.dumps(config))
    (other / PROVENANCE_FILE).unlink()
    assert_one_line_error(invoke("evaluate", other, "--target", cli_run.target_json, *common), "target_layer_ids is [0, 2]", "[1, 3]")
    # An export of a drafter trained for another target: its provenance names that target.
    foreign = shutil.copytree(cli_run.export, tmp_path / "foreign")
    provenance = json.loads((foreign / PROVENANCE_FILE).read_text())
    provenance["source"]["target_fingerprint"] = "f" * 64
    (foreign / PROVENANCE_FILE).write_text(json.dumps(provenance))
    assert_one_line_error(invoke("evaluate", cli_run.checkpoint, foreign, "--target", cli_run.target_json, *common),
                          f"foreign/{PROVENANCE_FILE}", "source.target_fingerprint ffffffffffff", "is not this target's")
    assert_one_line_error(invoke("evaluate", cli_run.val, "--target", cli_run.target_json, *common), "pass it as --shards")
    not_parquet = cli_run.val / "manifest.json"
    assert_one_line_error(invoke("evaluate", cli_run.checkpoint, "--target", cli_run.target_json, "--prompts", not_parquet, *common),
                          "manifest.json", "Parquet")
    assert_one_line_error(invoke("evaluate", cli_run.checkpoint, "--target", cli_run.target_json, "--anchors", -1, *common), "--anchors")


def test_evaluate_takes_checkpoints_from_any_folders(cli_run, tmp_path):
    renamed = shutil.copytree(cli_run.checkpoint, tmp_path / "other-run" / "best")
    result = invoke("evaluate", cli_run.checkpoint, renamed, "--target", cli_run.target_json, "--shards", cli_run.val, "--anchors", 3,
                    "--e2e-prompts", 0, "--out", tmp_path / "eval", "--device", "cpu")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "eval" / "details.json").read_text())["candidates"]
    assert [row["kind"] for row in rows] == ["checkpoint", "checkpoint"] and rows[0]["name"] != rows[1]["name"]
    assert comparable(rows[0]) == comparable(rows[1])


def test_evaluate_refuses_an_answer_length_past_the_targets_context_before_scoring(cli_run):
    common = [cli_run.checkpoint, "--target", cli_run.target_json, "--shards", cli_run.val, "--device", "cpu"]
    assert_one_line_error(invoke("evaluate", *common, "--max-new-tokens", 4096),
                          "command line: key 'evaluate.max_new_tokens' plus a val prompt must fit the target's context, 4096 tokens")
    line = assert_one_line_error(invoke("evaluate", *common, "--prompts", cli_run.generated, "--max-new-tokens", 4095),
                                 "command line: key 'evaluate.max_new_tokens' (4095) plus val prompt ",
                                 "must fit the target's context, 4096 tokens (its max_position_embeddings, in target.json), got 4095")
    assert f"{cli_run.generated / 'val.parquet'} (" in line
