"""The `dflash-pipeline` console command: every subcommand on a tiny captured and trained run, the
installed entry point, and bad input as one line `error: ...` with exit status 1."""

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from support.helpers import REPO_ROOT, flip_a_byte, stage_env

from dflash_pipeline.cli import main
from dflash_pipeline.drafters.checkpoints import load_checkpoint
from dflash_pipeline.drafters.serving import PROVENANCE_FILE, load_dflash_drafter
from dflash_pipeline.export.run import export_checkpoint
from dflash_pipeline.foundation.config import CaptureConfig, TargetConfig, TrainConfig
from dflash_pipeline.target.load import TargetInfo, prepare_target

CYCLE = [101, 202, 303, 404, 505]  # every answer repeats it, so a few training steps already draft some tokens right
SUBCOMMANDS = ["evaluate", "verify-shards", "verify", "show", "export", "plots", "compare-runs", "generate"]


def write_cycle_generated(folder: Path, rows_per_split: dict[str, int], seed: int = 0) -> Path:
    """A generate-stage output whose answers cycle through CYCLE (prompts are random ids)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.data.prompts import GENERATED_SCHEMA

    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in rows_per_split.items():
        rows = []
        for index in range(count):
            prompt = torch.randint(3, 49152, (int(torch.randint(6, 16, (1,), generator=generator)),), generator=generator).tolist()
            start = int(torch.randint(0, len(CYCLE), (1,), generator=generator))
            length = int(torch.randint(16, 40, (1,), generator=generator))
            rows.append({"prompt_id": f"{split}{index:04d}", "category": ("code", "math")[index % 2], "split": split,
                         "messages": [{"role": "user", "content": "x"}], "prompt_ids": prompt,
                         "answer_ids": [CYCLE[(start + k) % len(CYCLE)] for k in range(length)], "finish_reason": "length"})
        pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), folder / f"{split}.parquet")
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """Target fingerprint, generated val prompts, captured shards and one checkpoint (step 4) on the
    tiny Llama, plus a float32 export of that checkpoint."""
    from dflash_pipeline.capture.run import run_capture
    from dflash_pipeline.train.run import run_train

    root = tmp_path_factory.mktemp("cli")
    prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=root / "target")
    target = TargetInfo.from_json(root / "target" / "target.json")
    generated = write_cycle_generated(root / "generated", {"train": 12, "val": 3})
    run_capture(CaptureConfig(layer_ids=[1, 3]), target=target, generated_dir=generated, out_dir=root / "hidden", device="cpu")
    train = TrainConfig(num_layers=1, block_size=4, max_steps=4, tokens_per_step=400, anchors_per_sequence=8, eval_every=4,
                        save_every=4, eval_blocks=16, logits_chunk=64, lr=2e-2)
    run_train(train, target=target, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val", out_dir=root / "checkpoints",
              device="cpu", log=lambda *_: None)
    checkpoint = root / "checkpoints" / "step_000004"
    export = export_checkpoint(checkpoint, root / "export")
    return SimpleNamespace(root=root, target_json=root / "target" / "target.json", model_dir=tiny_llama_dir, generated=generated,
                           hidden=root / "hidden", val=root / "hidden" / "val", checkpoint=checkpoint, export=export)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == "", result.stdout
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def comparable(candidate: dict) -> dict:
    """The teacher-forced numbers of one candidate of details.json (not its name, kind, path or timing)."""
    scored = {key: value for key, value in candidate["teacher_forced"].items() if key != "seconds"}
    return {"teacher_forced": scored, "tree": candidate["tree"], "vs_chosen": candidate["vs_chosen"], "extras": candidate.get("extras")}


# ----------------------------------------------------------------------------- help and the entry point


@pytest.mark.parametrize("command", [[]] + [[name] for name in SUBCOMMANDS])
def test_every_subcommand_explains_itself_with_an_example(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: {' '.join(['main'] + command)}")
    if command:
        assert "Example" in result.output and f"dflash-pipeline {command[0]} " in result.output
    else:
        assert all(name in result.output for name in SUBCOMMANDS)


@pytest.mark.subprocess
def test_installed_console_script_runs_and_fails_in_one_line(tiny, tmp_path):
    script = Path(sys.executable).parent / "dflash-pipeline"
    assert script.is_file(), "console script missing: pip install --no-deps -e . (pyproject.toml [project.scripts])"
    helped = subprocess.run([script, "--help"], env=stage_env(), capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and all(name in helped.stdout for name in SUBCOMMANDS), helped.stderr
    verified = subprocess.run([script, "verify-shards", tiny.val], env=stage_env(), capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0 and "ok, 3 sequences" in verified.stdout, verified.stderr
    missing = subprocess.run([script, "show", tmp_path / "nope"], env=stage_env(), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("error: ") and "nope" in missing.stderr


def test_the_group_help_lists_every_registered_command_with_a_one_line_summary():
    result = CliRunner().invoke(main, ["--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    listing = result.output.split("Commands:\n", 1)[1].splitlines()
    assert sorted(main.commands) == sorted(SUBCOMMANDS)
    assert [line.split()[0] for line in listing] == sorted(main.commands), listing  # one line each, none wrapped
    for line in listing:
        name, summary = line.split(maxsplit=1)
        assert summary == main.commands[name].short_help, line  # in full, not cut short with "..."


def test_version_prints_the_package_version():
    from importlib.metadata import version

    import dflash_pipeline

    for flag in ("--version", "-V"):
        result = invoke(flag)
        assert result.exit_code == 0 and result.output == f"dflash-pipeline, version {dflash_pipeline.__version__}\n", result.output
    assert dflash_pipeline.__version__ == version("dflash-pipeline")  # pyproject.toml's


@pytest.mark.parametrize("command", [name for name in SUBCOMMANDS if any(p.name == "device" for p in main.commands[name].params)])
def test_a_bad_device_is_a_one_line_error(command, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU build of torch, whatever this machine has
    arguments = {"evaluate": [tmp_path, "--target", tmp_path, "--shards", tmp_path],
                 "generate": ["hi", "--target", tmp_path, "--drafter", tmp_path]}[command]
    assert_one_line_error(invoke(command, *arguments, "--device", "tpu"), "--device 'tpu': not a device", "available here: auto, cpu")
    for device in ("cuda", "cuda:1"):  # torch's own 41-line AssertionError once the models started loading
        assert_one_line_error(invoke(command, *arguments, "--device", device), f"--device {device}: ", "available here: auto, cpu")


def test_the_device_option_appears_on_the_decoding_commands():
    assert {name for name in SUBCOMMANDS if any(p.name == "device" for p in main.commands[name].params)} == {"evaluate", "generate"}


def test_generate_defaults_are_params_yaml_values():
    from dflash_pipeline.foundation.config import load_params

    params = load_params(REPO_ROOT / "params.yaml")
    defaults = {p.name: p.default for p in main.commands["generate"].params}
    assert defaults["rule"] == params.evaluate.sampling_rule
    assert defaults["seed"] == params.evaluate.seed
    assert defaults["verify_tokens"] == params.evaluate.verify_tokens
    assert defaults["max_new_tokens"] == params.generate.max_new_tokens
    assert defaults["temperature"] == 0.0 and 0.0 in params.evaluate.temperatures  # greedy, always part of evaluate
    assert defaults["device"] == "auto"


# ----------------------------------------------------------------------------- verify-shards


def test_verify_shards_passes_a_good_split_and_names_the_corrupt_shard(tiny, tmp_path):
    good = invoke("verify-shards", tiny.val)
    assert good.exit_code == 0, good.output
    assert "ok, 3 sequences" in good.stdout and "layers [1, 3] x 64 in bf16" in good.stdout
    both = invoke("verify-shards", tiny.hidden)  # a capture output: each split
    assert both.exit_code == 0 and both.stdout.count(": ok, ") == 2, both.output

    split = shutil.copytree(tiny.val, tmp_path / "val")
    shard = split / "shard-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))
    assert_one_line_error(invoke("verify-shards", split), str(shard), "sha256")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("verify-shards", tmp_path / "empty"), "no manifest.json")


def test_verify_shards_with_a_target_refuses_shards_of_another_target(tiny, tmp_path):
    # Without --target, shards captured from another model verify fine: they match their own manifest.
    good = invoke("verify-shards", tiny.hidden, "--target", tiny.target_json)
    assert good.exit_code == 0 and good.stdout.count(": ok, ") == good.stdout.count("(matches --target)") == 2, good.output
    foreign = tmp_path / "target.json"
    foreign.write_text(json.dumps({**json.loads(tiny.target_json.read_text()), "fingerprint": "f" * 64}))
    assert invoke("verify-shards", tiny.val).exit_code == 0
    assert_one_line_error(invoke("verify-shards", tiny.val, "--target", foreign), str(tiny.val / "manifest.json"),
                          "target_fingerprint", f"fingerprint of {foreign} (ffffffffffff): captured from another target")


# ----------------------------------------------------------------------------- verify


def copy_run(tiny, root: Path) -> Path:
    """The tiny run laid out as the pipeline lays out its outputs (dvc.yaml's paths) under `root`."""
    data = root / "data"
    (data / "target").mkdir(parents=True)
    shutil.copy(tiny.target_json, data / "target" / "target.json")
    shutil.copytree(tiny.hidden, data / "hidden")
    shutil.copytree(tiny.root / "checkpoints", data / "checkpoints")
    shutil.copytree(tiny.export, data / "export" / "drafter")
    return root


def test_verify_checks_a_whole_run_and_repair_removes_what_is_damaged(tiny, tmp_path):
    run = copy_run(tiny, tmp_path / "run")
    data = run / "data"
    good = invoke("verify", run)
    assert good.exit_code == 0 and good.stdout == (f"verify: {run}: no damage found (target, generated answers, shards, checkpoints, "
                                                   "best choice, export, DVC cache) and no leftover\n"), good.output
    shard, weights = data / "hidden" / "val" / "shard-00000.arrow", data / "checkpoints" / "step_000004" / "model.safetensors"
    exported = data / "export" / "drafter" / "model.safetensors"
    for path in (shard, weights, exported):
        flip_a_byte(path)
    shutil.copytree(data / "hidden", data / "hidden.partial")  # a killed capture's staging folder, its output complete
    found = invoke("verify", run)
    assert found.exit_code == 1 and found.stderr.strip().splitlines() == [
        f"error: {run}: 4 problem(s) found; `dflash-pipeline verify --repair`, then `dvc pull` or `dvc repro` (README, Recovery)"]
    lines = found.stdout.splitlines()
    assert [line.split(": ")[1] for line in lines] == [str(shard), str(weights), str(exported), str(data / "hidden.partial")], lines
    assert all("damaged (sha256 " in line for line in lines[:3]) and "staging folder of a killed capture" in lines[3]

    repaired = invoke("verify", run, "--repair")
    assert repaired.exit_code == 0, repaired.output
    assert f"verify: removed {shard} (damaged)" in repaired.stdout and f"verify: removed {exported} (damaged)" in repaired.stdout
    assert f"verify: removed {weights.parent} (damaged)" in repaired.stdout
    # the only step went, and with it the only resume state: train says where it will start, not "from the step before"
    assert "verify: train starts from step 0: no step is left" in repaired.stdout.splitlines()
    assert f"verify: removed leftover {data / 'hidden.partial'}" in repaired.stdout and "dvc repro" in repaired.stdout.splitlines()[-1]
    assert not shard.exists() and not weights.parent.exists() and not (data / "checkpoints" / "state" / "step_000004.pt").exists()
    assert not (data / "hidden.partial").exists() and (data / "hidden" / "train" / "shard-00000.arrow").is_file()
    after = invoke("verify", run)  # until `dvc pull` or `dvc repro` brings them back
    assert after.exit_code == 1 and after.stdout.splitlines() == [f"verify: {shard}: missing (manifest.json records its sha256)",
                                                                  f"verify: {exported}: missing (dflash_pipeline.json records its sha256)"]


def test_a_damaged_val_parquet_is_refused_by_evaluate_in_one_line(tiny, tmp_path):
    # evaluate read val.parquet (prompt categories, end-to-end prompts) without a check, and the
    # command's --prompts read only its schema: a flipped bit in it was scored as if valid.
    from dflash_pipeline.evaluate.run import run_evaluate
    from dflash_pipeline.foundation.config import EvaluateConfig
    from dflash_pipeline.foundation.errors import PipelineError
    val = Path(shutil.copy(tiny.generated / "val.parquet", tmp_path / "val.parquet"))
    # generate's record of it (`sha256sum -c` format), spelled out here
    (tmp_path / "val.parquet.sha256").write_text(f"{hashlib.sha256(val.read_bytes()).hexdigest()}  val.parquet\n")
    flip_a_byte(val)
    with pytest.raises(PipelineError) as error:
        run_evaluate(EvaluateConfig(num_prompts=1), target=TargetInfo.from_json(tiny.target_json), hidden_val_dir=tiny.val,
                     generated_val=val, checkpoint_folders=[tiny.checkpoint], device="cpu", log=lambda *_: None)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{val}: damaged (sha256 ") and "val.parquet.sha256 records" in message, message
    assert_one_line_error(invoke("evaluate", tiny.checkpoint, "--target", tiny.target_json, "--shards", tiny.val, "--prompts", val,
                                 "--device", "cpu"), f"{val}: damaged (sha256 ", "val.parquet.sha256 records")


def test_show_refuses_damaged_weights_in_one_line(tiny, tmp_path):
    checkpoint = shutil.copytree(tiny.checkpoint, tmp_path / "step_000004")
    export = shutil.copytree(tiny.export, tmp_path / "export")
    assert "sha256 matches checkpoint.json" in contract(invoke("show", checkpoint))["weights"]
    assert "sha256 of 3 file(s) match dflash_pipeline.json" in contract(invoke("show", export))["weights"]
    flip_a_byte(checkpoint / "model.safetensors")
    flip_a_byte(export / "model.safetensors")
    assert_one_line_error(invoke("show", checkpoint), f"{checkpoint / 'model.safetensors'}: damaged (sha256 ", "checkpoint.json records")
    assert_one_line_error(invoke("show", export), f"{export / 'model.safetensors'}: damaged (sha256 ", "dflash_pipeline.json records")


# ----------------------------------------------------------------------------- show


def contract(result) -> dict[str, str]:
    assert result.exit_code == 0, result.output
    pairs = (line.partition(":") for line in result.stdout.splitlines()[1:] if line.startswith("  "))
    return {key.strip(): value.strip() for key, _, value in pairs}


def dflash_checkpoint(checkpoint: Path, out_dir: Path) -> Path:
    """A plain-DFlash checkpoint of `checkpoint`'s sizes and record (random weights): step_NNNNNN under `out_dir`'s parent."""
    from dataclasses import replace

    from dflash_pipeline.drafters.checkpoints import save_checkpoint
    from dflash_pipeline.drafters.core import DFlashDrafter

    drafter, info = load_checkpoint(checkpoint)
    own = ("format_version", "step", "drafter", "git_revision", "metrics", "weights_sha256", "resume_state_sha256")
    plain = DFlashDrafter(replace(drafter.config, architecture="dflash", options=None))
    return save_checkpoint(out_dir.parent, step=info["step"], drafter=plain, record={k: v for k, v in info.items() if k not in own},
                           metrics=info["metrics"])


def test_show_detects_each_kind_of_folder(tiny, tmp_path):
    fingerprint = TargetInfo.from_json(tiny.target_json).fingerprint
    checkpoint = contract(invoke("show", tiny.checkpoint))
    # the default architecture, DFlash2, named as what it is (it used to read "DFlash drafter")
    assert checkpoint["kind"] == "training checkpoint of a DFlash2 drafter" and checkpoint["step"] == "4"
    assert checkpoint["target fingerprint"] == fingerprint and checkpoint["target layer ids"] == "[1, 3]"
    assert checkpoint["hidden size"] == "64" and checkpoint["block size"].startswith("4 ") and checkpoint["weights"].startswith("float32")
    assert checkpoint["mask token id"].startswith(str(load_checkpoint(tiny.checkpoint)[0].config.mask_token_id))

    exported = contract(invoke("show", tiny.export))
    assert exported["kind"] == "DFlash2 drafter (serving format)" and exported["target fingerprint"] == fingerprint
    assert str(tiny.checkpoint) in exported["exported from"]
    for key in ("target layer ids", "hidden size", "block size", "mask token id", "vocab size", "drafter layers"):
        assert exported[key] == checkpoint[key], key

    split = contract(invoke("show", tiny.val))
    assert split["kind"].startswith("shard split 'val'") and split["target fingerprint"] == fingerprint
    assert split["target layer ids"] == "[1, 3]" and split["sequences"] == "3" and split["feature dtype"] == "bf16"
    both = invoke("show", tiny.hidden)
    assert both.exit_code == 0 and "shard split 'train'" in both.stdout and "shard split 'val'" in both.stdout

    dflash = export_checkpoint(dflash_checkpoint(tiny.checkpoint, tmp_path / "dflash" / "step_000004"), tmp_path / "dflash-export")
    assert contract(invoke("show", dflash))["kind"] == "DFlash drafter (serving format)"
    assert contract(invoke("show", tmp_path / "dflash" / "step_000004"))["kind"] == "training checkpoint of a DFlash drafter"

    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("show", tmp_path / "empty"), "not a checkpoint folder")
    assert_one_line_error(invoke("show", tiny.root / "checkpoints"), "name one of its step_NNNNNN folders")


# ----------------------------------------------------------------------------- export


def test_export_writes_a_folder_that_loads_back(tiny, tmp_path):
    result = invoke("export", tiny.checkpoint, tmp_path / "drafter", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert "bfloat16" in result.stdout
    drafter, info = load_dflash_drafter(tmp_path / "drafter")
    original, _ = load_checkpoint(tiny.checkpoint)
    assert info["stored_dtype"] == "bfloat16" and info["provenance"]["source"]["step"] == 4
    assert drafter.config == original.config
    # The feature scale travels folded into fc.weight; the draft vocabulary in its own file.
    expected = {**original.state_dict(), "fc.weight": original.folded_fc_weight().detach(),
                "feature_scale": torch.ones_like(original.feature_scale)}
    assert not torch.equal(original.feature_scale, expected["feature_scale"])  # the default recipe scales
    for name, tensor in expected.items():
        if name == "draft_vocab":
            assert original.draft_vocab.numel() > 0 and torch.equal(drafter.draft_vocab, original.draft_vocab)
            continue
        assert torch.equal(drafter.state_dict()[name], tensor.to(torch.bfloat16).float()), name

    assert_one_line_error(invoke("export", tiny.export, tmp_path / "again"), "no checkpoint.json")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    assert_one_line_error(invoke("export", tiny.checkpoint, tmp_path / "precious"), "refusing to replace it")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    assert_one_line_error(invoke("export", tiny.checkpoint, tmp_path / "x", "--dtype", "int8"), "--dtype")


# ----------------------------------------------------------------------------- evaluate


def test_evaluate_a_checkpoint_against_its_own_export_gives_identical_numbers(tiny, tmp_path):
    out = tmp_path / "eval"
    result = invoke("evaluate", tiny.checkpoint, tiny.export, "--target", tiny.target_json, "--shards", tiny.val, "--anchors", 0,
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
    manifest = json.loads((tiny.val / "manifest.json").read_text())
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


def test_evaluate_with_a_model_folder_target_and_val_prompts_decodes_losslessly(tiny):
    result = invoke("evaluate", tiny.checkpoint, "--target", tiny.model_dir, "--shards", tiny.hidden, "--prompts", tiny.generated,
                    "--anchors", 4, "--e2e-prompts", 1, "--max-new-tokens", 4, "--device", "cpu")
    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()[-2:]
    values = dict(zip(header.split(), row.replace(" *", "").split()))
    assert values["name"] == "step_000004" and float(values["lossless_rate"]) == 1.0 and float(values["e2e_tau"]) >= 1.0
    assert "NOT LOSSLESS" not in result.stdout
    assert_one_line_error(invoke("evaluate", tiny.checkpoint, "--target", tiny.model_dir, "--shards", tiny.hidden, "--temperatures", "1,x"),
                          "--temperatures")


def test_evaluate_bad_input_is_one_line(tiny, tiny_qwen3_dir, tmp_path):
    common = ["--shards", tiny.val, "--device", "cpu"]
    assert_one_line_error(invoke("evaluate", tmp_path / "nope", "--target", tiny.target_json, *common), "does not exist")
    assert_one_line_error(invoke("evaluate", tiny.checkpoint, "--target", tmp_path, *common), "neither a target.json")
    assert_one_line_error(invoke("evaluate", tiny.checkpoint, "--target", tiny.val / "manifest.json", *common), "not a target.json")
    # Another target (fingerprinted from its folder) than the one the shards were captured from.
    assert_one_line_error(invoke("evaluate", tiny.checkpoint, "--target", tiny_qwen3_dir, *common), "manifest.json", "captured from target")
    # A drafter wired to other target layers than the shards hold.
    other = shutil.copytree(tiny.export, tmp_path / "other-layers")
    config = json.loads((other / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 2]
    (other / "config.json").write_text(json.dumps(config))
    (other / PROVENANCE_FILE).unlink()
    assert_one_line_error(invoke("evaluate", other, "--target", tiny.target_json, *common), "target_layer_ids is [0, 2]", "[1, 3]")
    # An export of a drafter trained for another target: its provenance names that target.
    foreign = shutil.copytree(tiny.export, tmp_path / "foreign")
    provenance = json.loads((foreign / PROVENANCE_FILE).read_text())
    provenance["source"]["target_fingerprint"] = "f" * 64
    (foreign / PROVENANCE_FILE).write_text(json.dumps(provenance))
    assert_one_line_error(invoke("evaluate", tiny.checkpoint, foreign, "--target", tiny.target_json, *common),
                          f"foreign/{PROVENANCE_FILE}", "source.target_fingerprint ffffffffffff", "is not this target's")
    assert_one_line_error(invoke("evaluate", tiny.val, "--target", tiny.target_json, *common), "pass it as --shards")
    not_parquet = tiny.val / "manifest.json"
    assert_one_line_error(invoke("evaluate", tiny.checkpoint, "--target", tiny.target_json, "--prompts", not_parquet, *common),
                          "manifest.json", "Parquet")
    assert_one_line_error(invoke("evaluate", tiny.checkpoint, "--target", tiny.target_json, "--anchors", -1, *common), "--anchors")


def test_evaluate_takes_checkpoints_from_any_folders(tiny, tmp_path):
    renamed = shutil.copytree(tiny.checkpoint, tmp_path / "other-run" / "best")
    result = invoke("evaluate", tiny.checkpoint, renamed, "--target", tiny.target_json, "--shards", tiny.val, "--anchors", 3,
                    "--e2e-prompts", 0, "--out", tmp_path / "eval", "--device", "cpu")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "eval" / "details.json").read_text())["candidates"]
    assert [row["kind"] for row in rows] == ["checkpoint", "checkpoint"] and rows[0]["name"] != rows[1]["name"]
    assert comparable(rows[0]) == comparable(rows[1])


def _eval_folder(folder, tau_by_prompt: dict[str, list[int]], chosen="step_000100", with_prompt_ids=True):
    import pandas as pd

    folder.mkdir(parents=True)
    (folder / "best.json").write_text(json.dumps({"name": chosen}))
    rows = [{"drafter": name, "sequence": s, "prompt_id": prompt, "category": "chat", "anchor": a, "tau": tau + (name != chosen)}
            for name in (chosen, "step_000050") for s, (prompt, taus) in enumerate(tau_by_prompt.items()) for a, tau in enumerate(taus)]
    frame = pd.DataFrame(rows)
    (frame if with_prompt_ids else frame.drop(columns="prompt_id")).to_parquet(folder / "blocks.parquet", index=False)
    return folder


def test_compare_runs_pairs_the_chosen_drafters_by_prompt(tmp_path):
    taus = {"p1": [1, 2, 1, 3], "p2": [4, 4, 3], "p3": [1, 1, 2], "p4": [2, 3, 2, 2]}
    committed = _eval_folder(tmp_path / "committed", taus)
    same = invoke("compare-runs", committed, _eval_folder(tmp_path / "again", taus))
    assert same.exit_code == 0 and "on the same val blocks" in same.stdout
    assert "difference +0.0000 ± 0.0000 (paired over 4 prompts): not distinguishable at 95%" in same.stdout
    # another machine: one prompt's answer (so its blocks) differs, another prompt is missing
    drifted = {"p1": [1, 2, 2, 3], "p2": [4, 4, 3, 1], "p3": [1, 1, 2]}
    other = invoke("compare-runs", committed, _eval_folder(tmp_path / "other", drifted))
    assert "different val blocks" in other.stdout and "paired over 3 prompts" in other.stdout
    assert "not distinguishable at 95%" in other.stdout
    better = invoke("compare-runs", _eval_folder(tmp_path / "better", {p: [t + 1 for t in v] for p, v in taus.items()}), committed)
    assert "difference +1.0000 ± 0.0000" in better.stdout and "is better" in better.stdout
    assert_one_line_error(invoke("compare-runs", committed, _eval_folder(tmp_path / "old", taus, with_prompt_ids=False)),
                          "old/blocks.parquet: has no prompt_id column")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("compare-runs", committed, tmp_path / "empty"), "empty/best.json", "no best.json")


def test_generate_streams_the_answer_and_at_t0_equals_plain_decoding(tiny, tiny_qwen3_dir):
    for drafter in (tiny.checkpoint, tiny.export):
        result = invoke("generate", "Explain recursion.", "--target", tiny.target_json, "--drafter", drafter, "--max-new-tokens", 24,
                        "--compare")
        assert result.exit_code == 0, result.output
        lines = result.stdout.strip().splitlines()
        assert re.match(r"speculative \(greedy\): 24 tokens, [\d.]+ tokens per step, [\d.]+ tokens/s", lines[-2]), lines
        assert lines[-1].startswith("plain (greedy): 24 tokens") and lines[-1].endswith("identical answers"), lines
    tree = invoke("generate", "Explain recursion.", "--target", tiny.target_json, "--drafter", tiny.export, "--max-new-tokens", 24,
                  "--tree-budget", 6, "--compare")
    assert tree.exit_code == 0, tree.output
    assert "speculative (greedy, tree of 6): 24 tokens" in tree.stdout and tree.stdout.strip().endswith("identical answers"), tree.stdout
    assert_one_line_error(invoke("generate", "hi", "--target", tiny.target_json, "--drafter", tiny.export, "--tree-budget", 4,
                                 "--temperature", 1), "--tree-budget")
    sampled = [invoke("generate", "Explain recursion.", "--target", tiny.target_json, "--drafter", tiny.checkpoint, "--max-new-tokens", 16,
                      "--temperature", "0.8", "--rule", rule, "--seed", 3).stdout for rule in ("ratio", "ratio", "match")]
    assert sampled[0].splitlines()[:-1] == sampled[1].splitlines()[:-1]  # the same seed samples the same answer
    assert "speculative (T=0.8, ratio rule): 16 tokens" in sampled[0] and "T=0.8, match rule" in sampled[2]
    # a drafter trained for another target is refused with one line naming the field
    assert_one_line_error(invoke("generate", "hi", "--target", tiny_qwen3_dir, "--drafter", tiny.checkpoint),
                          "checkpoint.json: target_fingerprint")
    assert_one_line_error(invoke("generate", "hi", "--target", tiny.target_json, "--drafter", tiny.val), "a shard folder, not a drafter")


# ----------------------------------------------------------------------------- generate: evaluate's best mode

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


def generate_mode(folder: Path, kind: str = "checkpoint", *, explicit=(), tree_budget=None, verify_tokens=None, machine=EPYC):
    from dflash_pipeline.cli import choose_generate_mode

    mode, line = choose_generate_mode(drafter_dir=folder, kind=kind, block_size=16, tree_budget=tree_budget, verify_tokens=verify_tokens,
                                      explicit=set(explicit), machine=machine)
    return mode.tree_budget, mode.verify_tokens, line


def test_generate_refuses_a_prompt_that_with_its_answer_runs_past_the_targets_context(tiny):
    # An 8,500-token prompt was decoded past an 8192-token context without a word.
    prompt = "word " * 3950
    result = invoke("generate", prompt, "--target", tiny.target_json, "--drafter", tiny.export, "--max-new-tokens", 200, "--device", "cpu")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    line = result.stderr.strip().splitlines()[-1]  # after transformers' own weight-loading bar
    assert line.startswith("error: PROMPT is ") and "tokens in the target's chat template; with --max-new-tokens 200" in line, line
    assert "past the target's context of 4096 tokens (max_position_embeddings in " in line
    assert int(line.split("PROMPT is ")[1].split()[0]) + 200 > 4096 and "speculative" not in result.stdout


def test_evaluate_refuses_an_answer_length_past_the_targets_context_before_scoring(tiny):
    common = [tiny.checkpoint, "--target", tiny.target_json, "--shards", tiny.val, "--device", "cpu"]
    assert_one_line_error(invoke("evaluate", *common, "--max-new-tokens", 4096),
                          "command line: key 'evaluate.max_new_tokens' plus a val prompt must fit the target's context, 4096 tokens")
    line = assert_one_line_error(invoke("evaluate", *common, "--prompts", tiny.generated, "--max-new-tokens", 4095),
                                 "command line: key 'evaluate.max_new_tokens' (4095) plus val prompt ",
                                 "must fit the target's context, 4096 tokens (its max_position_embeddings, in target.json), got 4095")
    assert f"{tiny.generated / 'val.parquet'} (" in line


def test_generate_takes_the_mode_evaluate_measured_fastest_and_says_why(tmp_path):
    step = pipeline_run(tmp_path, best_mode=tree4_record())
    budget, verify, line = generate_mode(step)
    assert (budget, verify) == (4, None)
    assert line == (f"mode: DDTree budget 4: evaluate measured 1.08x vs chain 0.97x, tree8 1.02x on {EPYC} "
                    f"({tmp_path / 'data' / 'eval' / 'best.json'}: best_mode)")
    assert "another mode may pay better" in generate_mode(step, machine="cuda on an H200")[2]  # measured elsewhere: said so
    # where the chain won, at the verify length evaluate planned
    chain = tree4_record(mode="chain", speedup=1.15, tree_budget=None, verify_tokens=2, speedups={"chain": 1.15, "tree4": 0.95})
    shutil.rmtree(tmp_path / "data")
    step = pipeline_run(tmp_path, best_mode=chain)
    budget, verify, line = generate_mode(step)
    assert (budget, verify) == (None, 2)
    assert line.startswith("mode: chain verifying 2 of 15 drafted tokens: evaluate measured 1.15x vs tree4 0.95x")


def test_generate_flags_override_the_evaluated_mode(tmp_path):
    step = pipeline_run(tmp_path, best_mode=tree4_record())
    assert generate_mode(step, explicit={"verify_tokens"}, verify_tokens=3) == (None, 3, "mode: chain verifying 3 of 15 drafted tokens "
                                                                                         "(--verify-tokens)")
    assert generate_mode(step, explicit={"tree_budget"}, tree_budget=8) == (8, None, "mode: DDTree budget 8 (--tree-budget)")


def test_generate_without_an_evaluate_record_keeps_the_whole_chain_and_says_so(tmp_path):
    alone = tmp_path / "alone" / "checkpoints" / "step_000004"
    alone.mkdir(parents=True)
    assert generate_mode(alone) == (None, None, f"mode: chain of all 15 drafted tokens (no evaluate record of this drafter: "
                                                f"no {tmp_path / 'alone' / 'eval' / 'best.json'} beside this checkpoint's run)")
    other = pipeline_run(tmp_path / "other", best_mode=tree4_record()).with_name("step_000002")
    other.mkdir()
    assert generate_mode(other)[:2] == (None, None) and "chose 'step_000004', not this checkpoint" in generate_mode(other)[2]
    old = pipeline_run(tmp_path / "old")  # a best.json of before the best mode
    assert generate_mode(old)[:2] == (None, None) and "records no best_mode" in generate_mode(old)[2]
    lossy = pipeline_run(tmp_path / "lossy", best_mode=tree4_record(mode=None, speedup=None, tree_budget=None))
    assert generate_mode(lossy) == (None, None, f"mode: chain of all 15 drafted tokens (evaluate found no lossless greedy mode: "
                                                f"{tmp_path / 'lossy' / 'data' / 'eval' / 'best.json'}: best_mode)")
    undecoded = pipeline_run(tmp_path / "undecoded", best_mode=None)  # evaluate ran without --prompts / num_prompts 0
    assert generate_mode(undecoded)[:2] == (None, None) and "evaluate decoded nothing end to end" in generate_mode(undecoded)[2]
    published = tmp_path / "published"
    published.mkdir()
    assert "has no dflash_pipeline.json" in generate_mode(published, "drafter")[2]


@pytest.mark.parametrize("changes, fragment", [({"mode": "beam"}, "best_mode.mode is 'beam'"),
                                               ({"tree_budget": "4"}, "best_mode.tree_budget is '4', expected an integer >= 1"),
                                               ({"tree_budget": 8}, "best_mode: mode 'tree4' and tree_budget 8 disagree"),
                                               ({"speedups": [1.0]}, "best_mode.speedups is list")])
def test_a_malformed_evaluate_record_is_one_error_naming_the_file_and_key(tmp_path, changes, fragment):
    from dflash_pipeline.foundation.errors import PipelineError

    step = pipeline_run(tmp_path, best_mode=tree4_record(**changes))
    with pytest.raises(PipelineError, match=re.escape(f"{tmp_path / 'data' / 'eval' / 'best.json'}: {fragment}")):
        generate_mode(step)


def test_generate_refuses_an_evaluate_record_that_differs_from_its_sha256(tmp_path):
    # best.json decides the mode `generate` decodes with; a flipped bit in it was taken as measured.
    from dflash_pipeline.foundation.errors import PipelineError

    step = pipeline_run(tmp_path, best_mode=tree4_record())
    best_json = tmp_path / "data" / "eval" / "best.json"
    (best_json.parent / "best.json.sha256").write_text(f"{hashlib.sha256(best_json.read_bytes()).hexdigest()}  best.json\n")
    assert generate_mode(step)[:2] == (4, None)
    best_json.write_text(best_json.read_text().replace('"speedup": 1.08', '"speedup": 1.88'))
    with pytest.raises(PipelineError, match=re.escape(f"{best_json}: damaged (sha256 ")):
        generate_mode(step)


@pytest.mark.slow  # four generate runs and an export: ~30 s on two cores
def test_generate_decodes_with_the_evaluated_mode_of_a_checkpoint_and_of_its_export(tiny, tmp_path):
    import importlib.util

    step = pipeline_run(tmp_path, tiny.checkpoint, best_mode=tree4_record(tree_budget=3, mode="tree3", speedups={"chain": 0.97, "tree3": 1.08}))
    result = invoke("generate", "Explain recursion.", "--target", tiny.target_json, "--drafter", step, "--max-new-tokens", 16, "--compare",
                    "--device", "cpu")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("mode: DDTree budget 3: evaluate measured 1.08x vs chain 0.97x"), lines[0]
    assert lines[-2].startswith("speculative (greedy, tree of 3): 16 tokens") and lines[-1].endswith("identical answers"), lines
    flagged = invoke("generate", "Explain recursion.", "--target", tiny.target_json, "--drafter", step, "--max-new-tokens", 16,
                     "--verify-tokens", 1, "--device", "cpu")
    assert flagged.stdout.startswith("mode: chain verifying 1 of 3 drafted tokens (--verify-tokens)\n"), flagged.stdout
    assert "speculative (greedy): 16 tokens" in flagged.stdout
    sampled = invoke("generate", "hi", "--target", tiny.target_json, "--drafter", step, "--max-new-tokens", 4, "--temperature", 1,
                     "--device", "cpu")
    assert "mode:" not in sampled.stdout and "speculative (T=1.0, ratio rule)" in sampled.stdout  # a greedy measurement: T = 0 only

    # the export stage carries best.json's mode into the exported folder's provenance file
    spec = importlib.util.spec_from_file_location("export_stage", REPO_ROOT / "stages" / "export.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    best_json = tmp_path / "data" / "eval" / "best.json"
    best_json.write_text(json.dumps({**json.loads(best_json.read_text()), "path": str(step)}))
    exported = CliRunner().invoke(stage.main, ["--params", str(REPO_ROOT / "params.yaml"), "--best", str(best_json),
                                               "--out", str(tmp_path / "drafter")], catch_exceptions=False)
    assert exported.exit_code == 0 and "best mode tree3, speedup 1.08" in exported.stdout, exported.output
    assert json.loads((tmp_path / "drafter" / PROVENANCE_FILE).read_text())["source"]["best_mode"]["tree_budget"] == 3
    assert "best decoding mode: tree3, speedup 1.08" in invoke("show", tmp_path / "drafter").stdout
    result = invoke("generate", "Explain recursion.", "--target", tiny.target_json, "--drafter", tmp_path / "drafter", "--max-new-tokens",
                    16, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"mode: DDTree budget 3: evaluate measured 1.08x vs chain 0.97x on {EPYC} "
                                    f"({tmp_path / 'drafter' / PROVENANCE_FILE}: source.best_mode)")
    assert "speculative (greedy, tree of 3): 16 tokens" in result.stdout
