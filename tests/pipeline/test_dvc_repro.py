"""The pipeline as users drive it: real `dvc repro` in a fresh git repo on the tiny target. (A kill -9
during `dvc repro`, and what DVC leaves after it: tests/integrity/test_checks.py.)"""

import csv
import json
import re
import shutil

import pyarrow.parquet as pq
import pytest
from support.helpers import (
    SAMPLE_PROMPTS,
    run,
    set_params,
    strict_json_load,
    write_jsonl,
)

from dflash_pipeline.data.shards import open_split

pytestmark = [pytest.mark.slow, pytest.mark.dvc]  # test lanes (pyproject.toml)


def dvc(repo, *args, check=True):
    return run(["dvc", *args], cwd=repo, check=check)


def test_repro_runs_stages_then_only_what_is_stale(tiny_pipeline_reproduced_once, reproduced_tiny_pipeline):
    # The session's one run from nothing (every other DVC test starts from a copy of it), then its copy.
    first, repo = tiny_pipeline_reproduced_once.first_repro, reproduced_tiny_pipeline
    for stage in ("target", "generate", "capture", "train", "evaluate", "export"):
        assert f"Running stage '{stage}'" in first.stdout
    train = pq.read_table(repo / "data" / "generated" / "train.parquet")
    val = pq.read_table(repo / "data" / "generated" / "val.parquet")
    assert train.num_rows + val.num_rows == 8
    target = json.loads((repo / "data" / "target" / "target.json").read_text())
    assert target["num_layers"] == 4
    shards = open_split(repo / "data" / "hidden" / "train", expected_fingerprint=target["fingerprint"])
    assert len(shards) == train.num_rows and shards.manifest.layer_ids == [1, 3]
    assert run(["git", "status", "--porcelain"], repo).stdout == ""  # the run is committed

    second = dvc(repo, "repro")
    assert "Running stage" not in second.stdout
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")

    # A capture parameter makes capture stale, not what comes before it (`dvc repro capture` stops there:
    # train, evaluate and export would rerun after any change of the shards, which the first run showed).
    set_params(repo, capture={"feature_dtype": "fp8_e4m3"})
    stale = [line for line in dvc(repo, "status").stdout.splitlines() if line.endswith(":") and not line[:1].isspace()]
    assert stale == ["capture:"], stale
    capture_only = dvc(repo, "repro", "capture")
    assert "Running stage 'capture'" in capture_only.stdout
    assert "Running stage 'generate'" not in capture_only.stdout and "Running stage 'target'" not in capture_only.stdout
    assert open_split(repo / "data" / "hidden" / "val").manifest.feature_dtype == "fp8_e4m3"

    # A generate parameter makes generate and what follows it stale, not target.
    set_params(repo, generate={"max_new_tokens": 5})
    third = dvc(repo, "repro", "capture")
    assert "Running stage 'generate'" in third.stdout and "Running stage 'capture'" in third.stdout
    assert "Running stage 'target'" not in third.stdout
    rows = pq.read_table(repo / "data" / "generated" / "train.parquet").to_pylist()
    assert all(len(r["answer_ids"]) == 5 for r in rows)
    assert sum(open_split(repo / "data" / "hidden" / "train").lengths()) == sum(len(r["prompt_ids"]) + 5 for r in rows)

    # More prompts reuse every answer already generated with the same settings.
    set_params(repo, generate={"max_prompts": 12})
    fourth = dvc(repo, "repro", "capture")
    assert "resuming, 8 of 12 prompts already answered" in fourth.stdout
    this_run = json.loads((repo / "data" / "metrics" / "generate.json").read_text())
    assert this_run["reused_answers"] == 8 and this_run["prompts"] == 4
    assert json.loads((repo / "data" / "metrics" / "capture.json").read_text())["train"]["seconds"] > 0


def test_a_changed_target_makes_generate_stale(reproduced_tiny_pipeline, tiny_qwen3_dir):
    repo = reproduced_tiny_pipeline
    set_params(repo, target={"model": str(tiny_qwen3_dir), "watch": str(tiny_qwen3_dir)})
    again = dvc(repo, "repro")
    for stage in ("target", "generate", "capture"):
        assert f"Running stage '{stage}'" in again.stdout
    assert "discarded" in again.stdout  # answers of the old target are not reused
    target = json.loads((repo / "data" / "target" / "target.json").read_text())
    assert target["architecture"] == "Qwen3ForCausalLM"
    open_split(repo / "data" / "hidden" / "train", expected_fingerprint=target["fingerprint"])
    # a Qwen3 target decodes on the one engine in the generate stage and in evaluate (issue #36),
    # as the default Llama does, not on a slower loop nobody named
    assert json.loads((repo / "data" / "generated" / "summary.json").read_text())["settings"]["engine"] == "static-kv"
    details = json.loads((repo / "data" / "eval" / "details.json").read_text())
    assert details["chain"]["engine"] == "static-kv" and "Running stage 'evaluate'" in again.stdout
    # ... and in `dflash-pipeline decode`, which names it; the export carries the engine its best mode was measured on
    from click.testing import CliRunner

    from dflash_pipeline.cli import main

    provenance = json.loads((repo / "data" / "export" / "drafter" / "dflash_pipeline.json").read_text())
    assert provenance["source"]["best_mode"]["engine"] == "static-kv"
    result = CliRunner().invoke(main, ["decode", "Say hi.", "--target", str(repo / "data" / "target" / "target.json"),
                                       "--drafter", str(repo / "data" / "export" / "drafter"), "--max-new-tokens", "8", "--compare"])
    assert result.exit_code == 0, result.output
    assert "on the static-kv engine" in result.output and result.output.strip().endswith("identical answers"), result.output


def test_bad_param_fails_the_stage_with_the_key(tiny_pipeline):
    repo = tiny_pipeline
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("batch_size: 4", "batch_sise: 4"))
    result = dvc(repo, "repro", check=False)
    assert result.returncode != 0
    assert "error: params.yaml: unknown key 'generate.batch_sise'" in result.stderr + result.stdout


def test_an_experiment_reruns_only_stale_stages_and_metrics_diff_shows_it(reproduced_tiny_pipeline):
    repo = reproduced_tiny_pipeline  # the baseline run, committed
    baseline_eval = json.loads((repo / "data" / "metrics" / "eval.json").read_text())
    details = json.loads((repo / "data" / "eval" / "details.json").read_text())
    assert {"tau", "tau_ci95", "blocks", "prompts"} <= set(baseline_eval["teacher_forced"])
    assert {"tau", "speedup", "lossless_rate", "break_even_tau"} <= set(baseline_eval["chain"])
    assert baseline_eval["chain"]["lossless_rate"] == 1.0 and details["chain"]["acceptance_rate"] > 0
    # greedy trees at every budget (lossless too) and a sampled chain at T = 1, end to end
    assert all({"streak", "tau", "speedup"} <= set(baseline_eval["tree"][str(b)]) for b in (4, 8, 16))
    assert all(details["tree"][str(b)]["lossless_rate"] == 1.0 and "verify_cost_steps" in details["tree"][str(b)] for b in (4, 8, 16))
    assert set(baseline_eval["sampled"]["1.0"]) == {"tau", "speedup"} and "acceptance_rate" in details["sampled"]["1.0"]
    shown = json.loads(dvc(repo, "metrics", "show", "--json").stdout)
    shown_eval = next(iter(shown.values()))["data"]["data/metrics/eval.json"]["data"]
    assert shown_eval["tree"]["16"]["speedup"] == baseline_eval["tree"]["16"]["speedup"] and "1.0" in shown_eval["sampled"]
    assert (repo / "data" / "export" / "drafter" / "config.json").is_file()

    # the default, DFlash2: trained, scored with its selector and exported in its contract
    assert {"tau_argmax", "tau_oracle", "tau_selector_gain", "slot1_topk_recall"} <= set(details["extras"])
    assert details["extras"]["tau_oracle"] >= details["teacher_forced"]["tau"]
    assert json.loads((repo / "data" / "export" / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]

    # the experiment also switches back to DFlash
    experiment = dvc(repo, "exp", "run", "-S", "train.lr=0.01", "-S", "evaluate.anchors_per_sequence=6", "-S", "train.architecture=dflash")
    for stage in ("train", "evaluate", "export"):
        assert f"Running stage '{stage}'" in experiment.stdout
    for stage in ("target", "generate", "capture"):
        assert f"Running stage '{stage}'" not in experiment.stdout

    params = json.loads(dvc(repo, "params", "diff", "--json").stdout)["params.yaml"]
    assert (params["train.lr"]["old"], params["train.lr"]["new"]) == (0.002, 0.01)
    metrics = json.loads(dvc(repo, "metrics", "diff", "--json").stdout)
    train_loss = metrics["data/metrics/train.json"]["loss"]
    assert train_loss["old"] != train_loss["new"]
    blocks = metrics["data/metrics/eval.json"]["teacher_forced.blocks"]
    assert blocks["new"] > blocks["old"]  # more anchors per val sequence: more blocks scored
    dflash_eval = json.loads((repo / "data" / "metrics" / "eval.json").read_text())
    assert "extras" not in json.loads((repo / "data" / "eval" / "details.json").read_text()) and dflash_eval["chain"]["lossless_rate"] == 1.0
    assert json.loads((repo / "data" / "export" / "drafter" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    shown = dvc(repo, "exp", "show", "--csv").stdout
    assert "0.01" in shown.splitlines()[-1] or any("0.01" in line for line in shown.splitlines()[1:])

    drawn = run(["dflash-pipeline", "plots", "HEAD", "--out", str(repo / "plots-diff")], repo).stdout
    for name in ("train_loss", "train_tau", "eval_tau_by_step", "eval_slots"):
        assert f"data_plots_{name}.png" in drawn and (repo / "plots-diff" / f"data_plots_{name}.png").stat().st_size > 1000


def test_a_two_prompt_file_gives_strict_json_everywhere_and_one_spelling_of_no_interval(tiny_pipeline):
    # One val prompt has no interval over prompts: tau_ci95 is infinite. It used to reach best.json,
    # every checkpoint.json and state.json as a bare Infinity, and the console as `+- inf` in one
    # place and `+- None` in another.
    repo = tiny_pipeline
    write_jsonl(repo / "data" / "prompts" / "two.jsonl", [SAMPLE_PROMPTS[0], {**SAMPLE_PROMPTS[1], "split": "val"}])
    set_params(repo, generate={"prompts": "data/prompts/two.jsonl"})
    result = dvc(repo, "repro")
    written = sorted((repo / "data").rglob("*.json"))
    assert {"best.json", "checkpoint.json", "state.json", "eval.json", "train.json", "details.json"} <= {p.name for p in written}
    for path in written:
        strict_json_load(path)
    assert strict_json_load(repo / "data" / "eval" / "best.json")["tau_ci95"] is None
    assert strict_json_load(repo / "data" / "checkpoints" / "step_000004" / "checkpoint.json")["metrics"]["tau_tf_ci95"] is None
    printed = result.stdout + result.stderr
    for stage in ("train: step 4", "evaluate: chosen step_", "export: step_"):
        line = next(line for line in printed.splitlines() if line.startswith(stage))
        assert "± n/a" in line, line
    for wrong in ("+- inf", "+- None", "± inf", "± None", "+-"):
        assert wrong not in printed, wrong
    # ... and an empty cell in every CSV file, which pandas and `dvc plots` read as missing, where `inf` was a number
    csvs = sorted((repo / "data").rglob("*.csv"))
    assert {"comparison.csv", "eval_tau_by_step.csv", "train_tau.csv"} <= {p.name for p in csvs}
    for path in csvs:
        assert not re.search(r"(^|,)-?(inf|nan)(,|$)", path.read_text(), re.MULTILINE), f"{path}:\n{path.read_text()}"
    assert next(csv.DictReader((repo / "data" / "plots" / "train_tau.csv").open()))["tau_ci95"] == ""


def test_editing_a_file_of_a_local_target_makes_the_target_stage_stale(tiny_pipeline, tiny_llama_dir, tmp_path):
    # dvc.yaml lists ${target.watch} (the local target folder) as a dependency of the target
    # stage: an edited file used to leave `dvc status` up to date and target.json silently stale.
    repo = tiny_pipeline
    folder = tmp_path / "my-target"
    shutil.copytree(tiny_llama_dir, folder)
    set_params(repo, target={"model": str(folder), "watch": "stages/target.py"})
    forgotten = dvc(repo, "repro", "target", check=False)
    assert forgotten.returncode != 0
    assert (f"error: params.yaml: key 'target.watch' must name target.model's local path {str(folder)!r}"
            in forgotten.stdout + forgotten.stderr)
    set_params(repo, target={"model": str(folder), "watch": str(folder)})
    dvc(repo, "repro", "target")
    assert dvc(repo, "status", "target").stdout.strip().endswith("Data and pipelines are up to date.")
    before = json.loads((repo / "data" / "target" / "target.json").read_text())
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text() + "{{ '' }}")
    status = dvc(repo, "status", "target").stdout
    assert "target:" in status and "changed deps" in status and f"modified:           {folder}" in status, status
    assert "Running stage 'target'" in dvc(repo, "repro", "target").stdout
    after = json.loads((repo / "data" / "target" / "target.json").read_text())
    assert after["hashes"]["chat_template"] != before["hashes"]["chat_template"] and after["fingerprint"] != before["fingerprint"]


def test_the_default_target_keeps_dvc_status_clean(pipeline_repo):
    # target.watch names stages/target.py for the embedded default (a path that always exists, and
    # already a dependency): listed twice, it still leaves `dvc status` clean after a run.
    dvc(pipeline_repo, "repro", "target")
    assert dvc(pipeline_repo, "status", "target").stdout.strip().endswith("Data and pipelines are up to date.")
