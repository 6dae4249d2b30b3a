"""Capture's writer threads: the same shard bytes for any thread count, one thread per shard, one
fsync per shard, and a failure (in a writer or in the caller) that keeps finished shards only."""

import filecmp
import json
import math
import threading

import pytest
from support.helpers import write_generated

from dflash_pipeline.capture.forward import CapturedBatch
from dflash_pipeline.capture.plan import Sequence
from dflash_pipeline.capture.run import run_capture
from dflash_pipeline.capture.writers import ShardWriters, default_writer_threads
from dflash_pipeline.data import shards
from dflash_pipeline.data.shards import ShardWriter, verify_split
from dflash_pipeline.foundation.files import recorded_sha256
from dflash_pipeline.foundation.config import CaptureConfig
from dflash_pipeline.foundation.files import sha256_file

# 777 B/token (4 taps x 64 wide in bf16, top-32): ~1,350 tokens per 1 MiB shard, several shards per split.
CONFIG = CaptureConfig(layer_ids=[0, 1, 2, 3], shard_mb=1, batch_tokens=512)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    return write_generated(tmp_path_factory.mktemp("generated"), {"train": 80, "val": 30}, answer_len=(10, 80))


def _capture(target, generated, out, writer_threads):
    return run_capture(CONFIG, target=target, generated_dir=generated, out_dir=out, device="cpu", writer_threads=writer_threads)


def _assert_same_output(a, b):
    for split in ("train", "val"):
        manifest = json.loads((a / split / "manifest.json").read_text())
        assert manifest == json.loads((b / split / "manifest.json").read_text())
        for shard in manifest["shards"]:
            assert filecmp.cmp(a / split / shard["file"], b / split / shard["file"], shallow=False), shard["file"]


def test_shards_are_byte_identical_for_any_writer_count(tiny_llama_target, generated, tmp_path, monkeypatch):
    writes, syncs = [], []
    original_write, original_sync = ShardWriter.write, shards._HashingFile.sync

    def write(self, *args, **kwargs):
        writes.append((self.path, threading.current_thread().name))
        return original_write(self, *args, **kwargs)

    def sync(self):
        syncs.append(threading.current_thread().name)
        return original_sync(self)

    monkeypatch.setattr(ShardWriter, "write", write)
    monkeypatch.setattr(shards._HashingFile, "sync", sync)
    outputs = {}
    for threads in (0, 1, 3):
        writes.clear(), syncs.clear()
        outputs[threads] = tmp_path / f"hidden-{threads}"
        summary = _capture(tiny_llama_target, generated, outputs[threads], threads)
        shard_count = sum(split["shards"] for split in summary["splits"].values())
        assert summary["splits"]["train"]["shards"] >= 4  # enough shards for three threads to share
        assert len(syncs) == shard_count  # one fsync per shard, at its close
        threads_of = {}
        for path, name in writes:
            threads_of.setdefault(path, set()).add(name)
        assert all(len(names) == 1 for names in threads_of.values())  # a shard's batches stay on one thread
        used = set().union(*threads_of.values())
        if threads == 0:
            assert used == {threading.main_thread().name}
        else:
            assert threading.main_thread().name not in used and len(used) == threads
    _assert_same_output(outputs[0], outputs[1])
    _assert_same_output(outputs[0], outputs[3])


@pytest.mark.parametrize("where", ["writer thread", "caller"])
def test_a_failure_keeps_finished_shards_only_and_the_rerun_is_byte_identical(tiny_llama_target, generated, tmp_path, monkeypatch, where):
    """A writer thread's error, or a KeyboardInterrupt in the caller while shards are being
    written: raised in the caller, no temporary file left, finished shards kept for the rerun."""
    out = tmp_path / "hidden"
    staged = tmp_path / "hidden.partial" / "train"
    first_closed = threading.Event()
    original_init, original_write, original_close = ShardWriter.__init__, ShardWriter.write, ShardWriter.close

    def close(self):
        info = original_close(self)
        if self.path == staged / "shard-00000.arrow":
            first_closed.set()
        return info

    def failing_shard(self):
        # Fail on shard 4 only once shard 0 is finished, so that there is a finished shard to keep.
        if self.path == staged / "shard-00004.arrow":
            assert first_closed.wait(60), "shard 0 was never closed"
            return True
        return False

    def write(self, *args, **kwargs):
        if failing_shard(self):
            raise OSError(f"{self.tmp_path}: injected write failure")
        return original_write(self, *args, **kwargs)

    def init(self, path, **kwargs):
        original_init(self, path, **kwargs)
        if failing_shard(self):
            raise KeyboardInterrupt("injected")

    monkeypatch.setattr(ShardWriter, "close", close)
    if where == "writer thread":
        monkeypatch.setattr(ShardWriter, "write", write)
        expected = pytest.raises(OSError, match="injected write failure")
    else:
        monkeypatch.setattr(ShardWriter, "__init__", init)
        expected = pytest.raises(KeyboardInterrupt)
    with expected:
        _capture(tiny_llama_target, generated, out, 3)
    monkeypatch.undo()

    assert not list(staged.parent.rglob("*.tmp"))
    kept = sorted(staged.glob("shard-*.arrow"))
    assert staged / "shard-00000.arrow" in kept and staged / "shard-00004.arrow" not in kept
    for shard in kept:  # every shard left is whole and has the record a rerun checks it against
        assert recorded_sha256(shard) == sha256_file(shard)
    assert not (staged / "manifest.json").exists() and not out.exists()

    rerun = _capture(tiny_llama_target, generated, out, 3)
    assert rerun["this_run"]["train"]["shards_kept"] == len(kept)
    verify_split(out / "train")
    _capture(tiny_llama_target, generated, tmp_path / "reference", 0)
    _assert_same_output(out, tmp_path / "reference")


def test_a_shard_that_lost_a_batch_is_never_closed_into_place(tmp_path, monkeypatch):
    """Its later batch and its close are already queued on its thread when a batch fails: they
    are skipped, so the shard is not renamed into place short of a batch, and abort removes it."""
    import concurrent.futures

    import torch

    release, calls = threading.Event(), []
    original_write = ShardWriter.write

    def write(self, *args, **kwargs):
        calls.append(self.path)
        if len(calls) == 1:
            assert release.wait(60)
            raise OSError("injected: the first batch is lost")
        return original_write(self, *args, **kwargs)

    monkeypatch.setattr(ShardWriter, "write", write)
    batch = [Sequence("a", [5, 6, 7], [0, 1, 1])]
    captured = CapturedBatch([3], torch.zeros(1, 3, 4, dtype=torch.bfloat16), torch.zeros(1, 3, dtype=torch.int32),
                             torch.zeros(1, 3, 0, dtype=torch.int32), torch.zeros(1, 3, 0))
    writers = ShardWriters(2)
    writer = writers.open(tmp_path / "shard-00000.arrow", feature_dtype="bf16", feature_width=4, top_k=0)
    with pytest.raises(OSError, match="the first batch is lost"):
        try:
            writers.write(writer, batch, captured)  # blocks in its thread until released
            writers.write(writer, batch, captured)
            writers.close(writer)
            release.set()
            concurrent.futures.wait(writers.pending)  # the whole queue has had its turn
            writers.finish()
        except BaseException:
            writers.abort()
            raise
    assert calls == [writer.path]  # the second batch never reached the file
    assert list(tmp_path.iterdir()) == []


def test_the_default_writer_count_is_inline_on_a_cpu_and_threads_on_a_gpu():
    assert default_writer_threads("cpu") == 0
    assert 1 <= default_writer_threads("cuda") <= 4


def test_capture_figures_run_on_the_cpu_and_give_every_figure(tiny_llama_target, generated, tmp_path):
    """bench/gpu/capture_figures.py on the tiny target: every key bench/gpu/figures.py reads is there,
    and positive and finite (what the figures are is the bench's to report, not this test's)."""
    from bench.gpu.capture_figures import capture_figures

    from dflash_pipeline.capture.plan import SplitPlan, load_sequences
    from dflash_pipeline.target.load import load_target

    model, _ = load_target(tiny_llama_target)
    sequences, _ = load_sequences(generated / "train.parquet", max_length=CONFIG.max_length, on_too_long="truncate")
    plan = SplitPlan.make(sequences, config=CONFIG, target=tiny_llama_target, layer_ids=list(CONFIG.layer_ids), compute_dtype="float32")
    figures = capture_figures(model, plan, sequences, list(CONFIG.layer_ids), pad_id=2, feature_dtype="bf16",
                              folder=tmp_path / "bench", writer_threads=2, max_batches=6, disk_mb=8)
    for key in ("forward_tokens_per_s", "capture_gpu_path_tokens_per_s", "capture_gpu_path_vs_forward", "writer_gb_per_s",
                "writer_tokens_per_s", "disk_write_gb_per_s", "writer_vs_disk", "shard_bytes_per_token", "capture_bound_tokens_per_s",
                "capture_stage_tokens_per_s", "capture_stage_vs_bound"):
        assert isinstance(figures[key], float) and math.isfinite(figures[key]) and figures[key] > 0, (key, figures[key])
    assert figures["writer_threads"] == 2 and figures["capture_figures_shards"] >= 2
    assert list((tmp_path / "bench").iterdir()) == []  # shards and the disk probe are removed
