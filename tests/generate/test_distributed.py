"""Stage `generate` under torchrun (`launch.processes`): ranks answer their own batches of one plan,
rank 0 assembles the same bytes as one process, a rerun resumes every rank's chunks."""

import json
import sys

import pytest
from support.helpers import REPO_ROOT, folder_bytes, run, write_jsonl

from dflash_pipeline.data.prompts import read_prompts
from dflash_pipeline.foundation.config import GenerateConfig, TargetConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.generate.run import run_generate
from dflash_pipeline.target.load import prepare_target

PROMPTS = 18
BATCH = 4  # 5 batches: rank 0 answers three, rank 1 two


def _prompts(path):
    rows = [{"prompt": f"Question {i}: what comes after {i * 11}?", "category": ["math", "chat"][i % 2]} for i in range(PROMPTS)]
    return write_jsonl(path, rows)


def _stage(tmp_path, prompts, target_json, out, processes):
    params = tmp_path / "params.yaml"
    params.write_text((REPO_ROOT / "params.yaml").read_text().replace("batch_size: 64", f"batch_size: {BATCH}")
                      .replace("max_new_tokens: 256", "max_new_tokens: 10"))
    return [sys.executable, str(REPO_ROOT / "stages" / "launch.py"), "--processes", str(processes),
            str(REPO_ROOT / "stages" / "generate.py"), "--params", str(params), "--prompts", str(prompts), "--target", str(target_json),
            "--out", str(out), "--metrics", str(out.parent / f"{out.name}-metrics.json"), "--device", "cpu"]


def _answers(out):
    return {name: data for name, data in folder_bytes(out).items() if not name.startswith("chunks/")}


@pytest.mark.subprocess
def test_two_processes_answer_as_one_and_resume_each_others_chunks(tiny_llama_dir, tmp_path):
    prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=tmp_path / "target")
    target_json = tmp_path / "target" / "target.json"
    prompts = _prompts(tmp_path / "prompts.jsonl")
    run(_stage(tmp_path, prompts, target_json, tmp_path / "one", 1), cwd=tmp_path)
    result = run(_stage(tmp_path, prompts, target_json, tmp_path / "two", 2), cwd=tmp_path)
    assert "generate: train" in result.stdout  # rank 0 reports once
    assert _answers(tmp_path / "one") == _answers(tmp_path / "two")  # train/val.parquet, their sha256, summary.json
    chunks = sorted(p.name for p in (tmp_path / "two" / "chunks").glob("chunk-*.parquet"))
    assert chunks == [f"chunk-{n:05d}.parquet" for n in (0, 1, 2, 3, 4)], chunks  # rank r names r, r + 2, ...
    metrics = json.loads((tmp_path / "two-metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["prompts"] == PROMPTS and metrics["new_tokens"] > 0

    # As after a kill: rank 1's chunks are gone (and the splits never written); both ranks resume.
    for odd in (1, 3):
        (tmp_path / "two" / "chunks" / f"chunk-{odd:05d}.parquet").unlink()
        (tmp_path / "two" / "chunks" / f"chunk-{odd:05d}.parquet.sha256").unlink()
    for split in ("train", "val"):
        (tmp_path / "two" / f"{split}.parquet").unlink()
    resumed = run(_stage(tmp_path, prompts, target_json, tmp_path / "two", 2), cwd=tmp_path)
    assert f"resuming, {PROMPTS - 2 * BATCH} of {PROMPTS} prompts already answered" in resumed.stdout
    assert _answers(tmp_path / "one") == _answers(tmp_path / "two")
    assert json.loads((tmp_path / "two-metrics.json").read_text())["prompts"] == 2 * BATCH


def test_more_processes_than_prompts_is_one_line_naming_the_key(tiny_llama_target, tmp_path, monkeypatch):
    prompt_set = read_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "one"}, {"prompt": "two", "split": "val"}]), val_fraction=0.1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(PipelineError, match=r"params.yaml: key 'launch.processes' gives 3 processes .* more than the 2 prompt"):
        run_generate(prompt_set, config=GenerateConfig(), target=tiny_llama_target, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written, no process group joined
