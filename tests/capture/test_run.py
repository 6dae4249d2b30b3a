"""Stage `capture` as a whole: kill -9 resume, torchrun, refusals, a rerun that changes nothing (one
batch's forward: test_forward.py; the plan: test_plan.py; shards checked on resume: test_resume.py;
the layer-id convention: tests/target/test_load.py)."""

import json
import re
import sys

import pyarrow.parquet as pq
import pytest
import torch
from support.helpers import folder_bytes, run, start_then_kill_9, write_generated
from support.stage_commands import (
    assert_same_split,
    capture_metrics_path,
    capture_params,
    capture_stage_cmd,
)

from dflash_pipeline.data.shards import open_split
from dflash_pipeline.foundation.config import CaptureConfig, TargetConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import TargetInfo, load_target, prepare_target


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=out)
    info = TargetInfo.from_json(out / "target.json")
    model, _ = load_target(info)
    return info, model, out / "target.json"


@pytest.mark.subprocess
def test_stage_writes_verified_shards_and_kill_9_resume_is_byte_identical(tiny, tmp_path):
    info, model, target_json = tiny
    generated = write_generated(tmp_path / "generated", {"train": 240, "val": 12})
    params = capture_params(tmp_path, layer_ids=[1, 3], shard_mb=1, batch_tokens=1024)
    reference = tmp_path / "reference"
    result = run(capture_stage_cmd(params, generated, target_json, reference), cwd=tmp_path)
    assert "B/token ->" in result.stdout and "min at" in result.stdout  # the estimate printed up front

    dataset = open_split(reference / "train", expected_fingerprint=info.fingerprint)
    manifest = dataset.manifest
    assert manifest.layer_ids == [1, 3] and manifest.num_target_layers == 4
    assert len(manifest.shards) >= 8 and manifest.sequences == 240 == len(dataset)
    assert manifest.feature_width == 2 * 64 and manifest.tokens == sum(dataset.lengths())
    # Every stored feature equals the target's own forward on that sequence.
    rows = {r["prompt_id"]: r for r in pq.read_table(generated / "train.parquet").to_pylist()}
    for index in (0, len(dataset) - 1):
        sample = dataset[index]
        row = rows[sample.sequence_id]
        ids = row["prompt_ids"] + row["answer_ids"]
        assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == [0] * len(row["prompt_ids"]) + [1] * len(row["answer_ids"])
        with torch.inference_mode():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i + 1][0] for i in manifest.layer_ids], dim=-1)
        torch.testing.assert_close(sample.features.float(), expected, rtol=1e-2, atol=1e-2)
        assert (sample.target_next == out.logits[0].argmax(-1).int()).float().mean() > 0.99

    # A killed run leaves its finished shards in killed.partial and no output: the output folder
    # appears only whole, so DVC never sees (or caches) half a capture.
    killed, staging = tmp_path / "killed", tmp_path / "killed.partial"
    assert not staging.exists()
    start_then_kill_9(capture_stage_cmd(params, generated, target_json, killed), tmp_path,
                      lambda: len(list((staging / "train").glob("shard-*.arrow"))) >= 2)
    done = len(list((staging / "train").glob("shard-*.arrow")))
    assert 2 <= done < len(manifest.shards) and not (staging / "train" / "manifest.json").exists()
    assert not killed.exists()
    resumed = run(capture_stage_cmd(params, generated, target_json, killed), cwd=tmp_path)
    assert f"{done} already done" in resumed.stdout
    assert not staging.exists()
    assert_same_split(reference, killed)

    # Run again by hand (outside DVC): the finished output is the starting point, nothing is rewritten.
    repeat = run(capture_stage_cmd(params, generated, target_json, killed), cwd=tmp_path)
    assert f"{len(manifest.shards)} shard(s), {len(manifest.shards)} already done" in repeat.stdout, repeat.stdout
    assert_same_split(reference, killed)

    # Other settings discard old shards instead of mixing them in.
    params_fp8 = capture_params(tmp_path, layer_ids=[1, 3], shard_mb=1, batch_tokens=1024, feature_dtype="fp8_e4m3")
    again = run(capture_stage_cmd(params_fp8, generated, target_json, killed), cwd=tmp_path)
    assert "removed" in again.stdout
    assert open_split(killed / "train").manifest.feature_dtype == "fp8_e4m3"


@pytest.mark.subprocess
def test_two_torchrun_processes_write_the_same_shards_as_one(tiny, tmp_path):
    _, _, target_json = tiny
    generated = write_generated(tmp_path / "generated", {"train": 60, "val": 9}, answer_len=(10, 120))
    params = capture_params(tmp_path, layer_ids=[0, 3], shard_mb=1, batch_tokens=2048)
    run(capture_stage_cmd(params, generated, target_json, tmp_path / "single"), cwd=tmp_path)
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533")
    result = run(capture_stage_cmd(params, generated, target_json, tmp_path / "ddp", launcher=torchrun), cwd=tmp_path)
    assert len(json.loads((tmp_path / "ddp" / "train" / "manifest.json").read_text())["shards"]) >= 2
    assert_same_split(tmp_path / "single", tmp_path / "ddp")
    assert "capture train:" in result.stdout


def test_refuses_to_start_without_disk_space(tiny, tmp_path, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    from dflash_pipeline.capture import run as capture

    info, _, _ = tiny
    generated = write_generated(tmp_path / "generated", {"train": 4, "val": 2})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(capture.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(PipelineError, match=r"capture needs about .* only 1000\.0 B free"):
        capture.run_capture(CaptureConfig(layer_ids=[0, 2]), target=info, generated_dir=generated, out_dir=tmp_path / "out", device="cpu")
    assert list((tmp_path / "out" / "train").glob("shard-*")) == []
    assert shutil_module.disk_usage is not None


@pytest.mark.parametrize(
    "config, message",
    [
        (CaptureConfig(layer_ids=[1, 4]), r"^params.yaml: key 'capture.layer_ids' must hold layers in 0..3 for this target, got 4$"),
        (CaptureConfig(layer_ids=[2, 2]), r"^params.yaml: key 'capture.layer_ids' repeats a layer, got \[2, 2\]$"),
        (CaptureConfig(num_layers=2), r"^params.yaml: key 'capture.num_layers' repeats layers \[1, 1\] on a 4-layer target .*, got 2$"),
    ],
)
def test_bad_layer_choices_are_refused(tiny, tmp_path, config, message):
    from dflash_pipeline.capture import run as capture

    info, _, _ = tiny
    generated = write_generated(tmp_path / "generated", {"train": 2, "val": 1})
    with pytest.raises(PipelineError, match=message):
        capture.run_capture(config, target=info, generated_dir=generated, out_dir=tmp_path / "o", device="cpu")


def test_a_split_without_sequences_is_refused_before_the_target_loads(tiny, tmp_path, monkeypatch):
    from dflash_pipeline.capture import run as capture
    from dflash_pipeline.target import load

    info, _, _ = tiny
    generated = write_generated(tmp_path / "generated", {"train": 3, "val": 0})
    monkeypatch.setattr(load, "load_target", lambda *a, **k: pytest.fail("the target was loaded for a capture that cannot be used"))
    with pytest.raises(PipelineError, match=rf"^capture: {re.escape(str(generated / 'val.parquet'))}: the val split has no sequence "
                                            r"to capture \(0 row\(s\)\); rerun generate with more prompts$"):
        capture.run_capture(CaptureConfig(layer_ids=[1, 3]), target=info, generated_dir=generated, out_dir=tmp_path / "o", device="cpu")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.subprocess
def test_a_rerun_that_changes_no_shard_leaves_the_output_byte_identical(tiny, tmp_path):
    # Timings inside data/hidden changed its hash on every rerun, so train reran and "resumed" at
    # its last step; they live in the metrics file instead.
    _, _, target_json = tiny
    generated = write_generated(tmp_path / "generated", {"train": 6, "val": 2}, answer_len=(10, 40))
    params = capture_params(tmp_path, layer_ids=[1, 3])
    out = tmp_path / "hidden"
    run(capture_stage_cmd(params, generated, target_json, out), cwd=tmp_path)
    first = folder_bytes(out)
    assert {"summary.json", "train/manifest.json", "train/shard-00000.arrow", "val/capture.json"} <= set(first)
    this_run = json.loads(capture_metrics_path(out).read_text())
    assert this_run["train"]["shards_written"] == 1 and this_run["train"]["seconds"] > 0
    run(capture_stage_cmd(params, generated, target_json, out), cwd=tmp_path)
    assert folder_bytes(out) == first
    this_run = json.loads(capture_metrics_path(out).read_text())
    assert this_run["train"] == {"shards_written": 0, "shards_kept": 1, "tokens_written": 0, "seconds": this_run["train"]["seconds"],
                                 "tokens_per_s": None}
