"""scripts/demo.py (`make demo`): its params are valid params.yaml values, its prompts hold val and
train rows, and, in the slow lane, the whole demo on the tiny target: every stage through
`dvc repro`, then the console commands (the real target is what `make demo` itself runs)."""

import importlib.util
import shutil
import sys

import pytest
import yaml
from support.helpers import REPO_ROOT, run

from dflash_pipeline.foundation.errors import PipelineError


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", REPO_ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_params_are_valid_and_overrides_apply_last(tmp_path):
    demo = load_demo()
    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    demo.write_params(tmp_path, [demo.parse_override("train.max_steps=8"), demo.parse_override("capture.layer_ids=[1, 3]")])
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert params["generate"]["prompts"] == "data/prompts/demo.jsonl" and params["evaluate"]["num_prompts"] == 2
    assert params["train"]["max_steps"] == 8 and params["capture"]["layer_ids"] == [1, 3]
    with pytest.raises(PipelineError, match="unknown key 'train.max_stepz'"):
        demo.write_params(tmp_path, [demo.parse_override("train.max_stepz=8")])


def test_a_local_target_override_also_becomes_the_target_stage_dependency(tmp_path):
    """--set target.model=DIR alone must not be refused by the target stage's watch check."""
    demo = load_demo()
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    demo.write_params(tmp_path, [demo.parse_override(f"target.model={model_dir}")])
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["target"]["watch"] == str(model_dir)
    demo.write_params(tmp_path, [demo.parse_override(f"target.model={model_dir}"), demo.parse_override("target.watch=elsewhere")])
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["target"]["watch"] == "elsewhere"


def test_the_demo_prompts_are_pinned_val_rows_then_train_rows():
    import json

    demo = load_demo()
    rows = [json.loads(line) for line in demo.demo_prompts(REPO_ROOT / "data" / "prompts" / "default.jsonl")]
    assert len(rows) == demo.VAL_PROMPTS + demo.TRAIN_PROMPTS
    assert [row.get("split") for row in rows[:demo.VAL_PROMPTS]] == ["val"] * demo.VAL_PROMPTS
    assert all("split" not in row for row in rows[demo.VAL_PROMPTS:])


@pytest.mark.slow
@pytest.mark.dvc
def test_the_demo_runs_every_stage_and_command_on_the_tiny_target(tiny_llama_dir, tmp_path):
    scratch = tmp_path / "demo"
    result = run([sys.executable, str(REPO_ROOT / "scripts" / "demo.py"), "--scratch", str(scratch), "--set", f"target.model={tiny_llama_dir}",
                  "--set", "capture.layer_ids=[1, 3]", "--set", "train.train_vocab=full"], cwd=tmp_path, timeout=900)
    output = result.stdout
    for stage in ("target", "generate", "capture", "train", "evaluate", "export"):
        assert f"Running stage '{stage}'" in output, stage
    for command in ("show", "verify-shards", "decode", "evaluate"):
        assert f"  dflash-pipeline {command} " in output, command  # its line in the time table: it ran and passed
    assert "identical answers" in output and (scratch / "data" / "export" / "drafter" / "config.json").is_file()
    assert not (scratch / "data" / "target" / "model").exists()  # a model folder target is referenced, never copied
