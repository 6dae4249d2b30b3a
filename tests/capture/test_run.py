"""Stage `capture`: features equal a hand-run forward, resume, torchrun (the layer-id convention: tests/target/test_load.py)."""

import hashlib
import json
import re
import shutil
import sys

import pyarrow as pa
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

from dflash_pipeline.capture.run import (
    Sequence,
    forward_batch,
    load_sequences,
    plan_shards,
)
from dflash_pipeline.data.prompts import GENERATED_SCHEMA
from dflash_pipeline.data.shards import Manifest, open_split, verify_split
from dflash_pipeline.foundation.config import CaptureConfig, TargetConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import (
    LayerTap,
    TargetInfo,
    load_target,
    prepare_target,
)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=out)
    info = TargetInfo.from_json(out / "target.json")
    model, _ = load_target(info)
    return info, model, out / "target.json"


def test_batched_capture_equals_one_sequence_forwards(tiny):
    _, model, _ = tiny
    generator = torch.Generator().manual_seed(1)
    batch = [Sequence(f"s{i}", torch.randint(3, 49152, (n,), generator=generator).tolist(), [0] * 3 + [1] * (n - 3))
             for i, n in enumerate([17, 9, 12])]
    layer_ids = [1, 3]
    tap = LayerTap(model, layer_ids)
    batched = forward_batch(model, tap, batch, pad_id=2, top_k=5, logits_chunk=7)
    for sequence, captured in zip(batch, batched):
        with torch.inference_mode():
            out = model(torch.tensor([sequence.input_ids]), output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(captured.features, expected, rtol=1e-5, atol=1e-5)
        assert captured.target_next.tolist() == out.logits[0].argmax(-1).tolist()
        # The top-5: the full-vocabulary log-softmax's five largest, in order, per position.
        log_probs = torch.log_softmax(out.logits[0].float(), dim=-1)
        assert captured.topk_ids.shape == captured.topk_logprobs.shape == (len(sequence.input_ids), 5)
        torch.testing.assert_close(captured.topk_logprobs, log_probs.gather(1, captured.topk_ids.long()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(captured.topk_logprobs, log_probs.topk(5, dim=-1).values, rtol=1e-5, atol=1e-5)
        assert captured.topk_ids[:, 0].tolist() == captured.target_next.tolist()
    tap.remove()


def test_edge_cases_are_counted(tmp_path):
    rows = [
        {"prompt_ids": [5, 6], "answer_ids": []},  # empty answer
        {"prompt_ids": [5] * 10, "answer_ids": [7] * 10},  # truncated to 12: 2 answer tokens left
        {"prompt_ids": [5] * 14, "answer_ids": [7] * 3},  # no answer token within max_length
        {"prompt_ids": [], "answer_ids": [7, 8]},  # all-answer sequence
        {"prompt_ids": [1, 2], "answer_ids": [3]},
    ]
    table = pa.Table.from_pylist([{"prompt_id": str(i), "category": "c", "split": "train", "messages": [],
                                   "finish_reason": "stop", **row} for i, row in enumerate(rows)], schema=GENERATED_SCHEMA)
    pq.write_table(table, tmp_path / "train.parquet")
    sequences, stats = load_sequences(tmp_path / "train.parquet", max_length=12, on_too_long="truncate")
    assert [s.id for s in sequences] == ["1", "3", "4"]
    assert sequences[0].loss_mask == [0] * 10 + [1, 1]
    assert stats == {"rows": 5, "skipped_empty_answer": 1, "truncated": 2, "skipped_no_answer_within_max_length": 1, "all_answer_tokens": 1}
    sequences, stats = load_sequences(tmp_path / "train.parquet", max_length=12, on_too_long="skip")
    assert [s.id for s in sequences] == ["3", "4"] and stats["skipped_too_long"] == 2


def test_plan_batches_similar_lengths_and_respects_budgets():
    lengths = [50, 10, 30, 45, 12, 31, 29, 11]
    sequences = [Sequence(str(i), [1] * n, [1] * n) for i, n in enumerate(lengths)]
    plan = plan_shards(sequences, token_bytes=10, shard_bytes=1000, batch_tokens=100)
    flat = [i for shard in plan for batch in shard for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    for shard in plan:
        assert sum(lengths[i] for batch in shard for i in batch) * 10 <= 1000 or len(shard) == 1
        for batch in shard:
            assert len(batch) * max(lengths[i] for i in batch) <= 100 or len(batch) == 1


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


def _flip_a_feature_byte(shard):
    """Flip one bit inside the first sequence's feature values: the file stays a valid Arrow file
    with the right record-batch count, only its sha256 tells."""
    mapped = pa.memory_map(str(shard), "r")
    reader = pa.ipc.open_file(mapped)
    features = reader.get_batch(0).column("features").values
    mapped.seek(0)
    offset = features.buffers()[1].address - mapped.read_buffer().address + 7
    batches = reader.num_record_batches
    del reader, features, mapped
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x40
    shard.write_bytes(bytes(data))
    assert pa.ipc.open_file(pa.memory_map(str(shard), "r")).num_record_batches == batches


def test_a_corrupted_shard_is_rebuilt_not_recorded(tiny, tmp_path, capsys, monkeypatch):
    info, _, _ = tiny
    generated = write_generated(tmp_path / "generated", {"train": 6, "val": 2}, answer_len=(10, 40))
    config = CaptureConfig(layer_ids=[1, 3])
    out = tmp_path / "hidden"

    def capture():
        from dflash_pipeline.capture.run import run_capture

        capsys.readouterr()
        run_capture(config, target=info, generated_dir=generated, out_dir=out, device="cpu")
        return capsys.readouterr().out

    capture()
    split, shard = out / "train", out / "train" / "shard-00000.arrow"
    original = shard.read_bytes()
    assert not list(split.glob("*.sha256"))  # the manifest holds the hashes once the split is done

    # A finished split: the bit flip verify-shards reports is rebuilt, not written into a new manifest.
    _flip_a_feature_byte(shard)
    with pytest.raises(PipelineError, match="sha256 differs from the manifest"):
        verify_split(split)
    printed = capture()
    assert "capture train: rebuilding 1 shard(s) that do not match their recorded sha256: " \
           "shard-00000.arrow (sha256 differs from manifest.json)" in printed, printed
    assert "0 already done" in printed
    verify_split(split)
    assert shard.read_bytes() == original

    # A run killed before its manifest: the shard's own .sha256 record is the reference.
    shutil.rmtree(out)

    def killed(self, folder):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(Manifest, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        capture()
    monkeypatch.undo()
    staged = tmp_path / "hidden.partial" / "train"  # an unfinished run's shards wait beside the output
    assert not out.exists()
    assert (staged / shard.name).is_file() and (staged / "shard-00000.arrow.sha256").is_file() and not (staged / "manifest.json").exists()
    _flip_a_feature_byte(staged / shard.name)
    printed = capture()
    assert "shard-00000.arrow (sha256 differs from shard-00000.arrow.sha256)" in printed, printed
    assert shard.read_bytes() == original
    verify_split(split)

    # A shard with neither record cannot be checked, so it is rebuilt too; an intact one is kept.
    (split / "manifest.json").unlink()
    printed = capture()
    assert "shard-00000.arrow (no recorded sha256 to check it against)" in printed, printed
    (split / "manifest.json").unlink()
    (split / "shard-00000.arrow").write_bytes(original)
    (split / "shard-00000.arrow.sha256").write_text(hashlib.sha256(original).hexdigest() + "  shard-00000.arrow\n")
    printed = capture()
    assert "rebuilding" not in printed and "1 shard(s), 1 already done" in printed, printed
    verify_split(split)


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
