"""Writing a plan's shards: the device captures batch n + 1 while writer threads encode, hash and
write earlier batches, one shard per thread (`ShardWriters`); a shard appears under its name only
when complete, and its bytes do not depend on the thread count.
"""

import contextlib
import os
import threading
from pathlib import Path

from dflash_pipeline.capture.forward import CapturedBatch, capture_batch
from dflash_pipeline.capture.plan import Sequence, SplitPlan, shard_name
from dflash_pipeline.data.shards import ShardWriter
from dflash_pipeline.target.placement import model_device


def default_writer_threads(device_type: str) -> int:
    """Writer threads when the caller names none: on a GPU up to 4 (one shard each; hashing and
    Arrow release the GIL, so they run in parallel and keep up with the device), on a CPU none,
    since a thread there takes cores from the forward (6dfc1ff:bench/capture_writers.py measures it)."""
    if device_type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


class ShardWriters:
    """Shards written by `threads` writer threads, or inline when `threads` is 0.

    Shard i of a run goes to lane i % threads, a thread of its own: a shard's batches and its
    close run in submission order on one thread, so its bytes do not depend on the thread count,
    while different shards are encoded, hashed and written at the same time. At most
    `threads + 1` batches wait or run at once (a finished batch's host copy is released as soon
    as it is written). The first failure is raised in the caller, at its next submit or at
    `finish`; `abort` (on any failure, KeyboardInterrupt included) cancels what has not started,
    waits for what has, and removes every unfinished shard's temporary file, keeping the
    finished shards (renamed into place with their `.sha256` record) for the rerun."""

    def __init__(self, threads: int, *, on_written=None):
        from concurrent.futures import ThreadPoolExecutor

        self.threads = threads
        self.on_written = on_written
        self.progress_lock = threading.Lock()  # several threads count written tokens into one bar
        self.lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"capture-writer-{lane}") for lane in range(threads)]
        self.depth = threads + 1
        self.pending: list = []
        self.writers: list[ShardWriter] = []
        self.lane_of: dict[int, int] = {}  # id(writer) -> its lane
        self.failed: set[int] = set()  # id(writer) of shards whose write failed

    def open(self, path: Path, *, feature_dtype: str, feature_width: int, top_k: int) -> ShardWriter:
        try:
            writer = ShardWriter(path, feature_dtype=feature_dtype, feature_width=feature_width, top_k=top_k)
        except BaseException:
            # Not registered yet, so `abort` would not see it: its temporary file goes here.
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            raise
        self.lane_of[id(writer)] = len(self.writers) % max(self.threads, 1)
        self.writers.append(writer)
        return writer

    def write(self, writer: ShardWriter, batch: list[Sequence], captured: CapturedBatch) -> None:
        self._run(writer, self._write_batch, writer, batch, captured)

    def close(self, writer: ShardWriter) -> None:
        self._run(writer, ShardWriter.close, writer)

    def _write_batch(self, writer: ShardWriter, batch: list[Sequence], captured: CapturedBatch) -> None:
        for sequence, out in zip(batch, captured.rows()):
            writer.write(sequence.id, sequence.input_ids, sequence.loss_mask, out.target_next.numpy(), out.features,
                         out.topk_ids.numpy(), out.topk_logprobs.numpy())
        if self.on_written is not None:
            with self.progress_lock:
                self.on_written(sum(captured.lengths))

    def _run(self, writer: ShardWriter, task, *args) -> None:
        if not self.lanes:
            task(*args)
            return
        self.pending.append(self.lanes[self.lane_of[id(writer)]].submit(self._guarded, writer, task, *args))
        self._settle(self.depth)

    def _guarded(self, writer: ShardWriter, task, *args) -> None:
        # A shard's later batches and its close may already wait on its thread when a batch
        # fails: they must not run, or the close would rename a shard short of a batch into
        # place, with a sha256 record that a rerun would trust.
        if id(writer) in self.failed:
            return
        try:
            task(*args)
        except BaseException:
            self.failed.add(id(writer))
            raise

    def _settle(self, keep: int) -> None:
        """Wait until at most `keep` tasks are unfinished; raise the first failure seen."""
        from concurrent.futures import FIRST_COMPLETED, wait

        while True:
            for future in [f for f in self.pending if f.done()]:
                self.pending.remove(future)
                future.result()
            if len(self.pending) <= keep:
                return
            wait(self.pending, return_when=FIRST_COMPLETED)

    def finish(self) -> None:
        self._settle(0)
        for lane in self.lanes:
            lane.shutdown(wait=True)
        self.writers.clear()

    def abort(self) -> None:
        for future in self.pending:
            future.cancel()
        for lane in self.lanes:
            lane.shutdown(wait=True)  # a batch already being written finishes; nothing touches a file after this
        self.pending.clear()
        for writer in self.writers:
            if not writer.path.exists() or writer.tmp_path.exists():
                # The failure being raised is the one to report: a second one from a writer in a
                # broken state must not stop the other temporary files from being removed.
                with contextlib.suppress(Exception):
                    writer.abort()
        self.writers.clear()
        self.lane_of.clear()


def write_planned_shards(numbers: list[int], plan: "SplitPlan", sequences: list[Sequence], *, out_dir: Path, feature_dtype: str,
                         produce, writer_threads: int, on_written=None) -> None:
    """Write the given shards of `plan`, each under a temporary name renamed into place when
    complete; `produce(batch)` gives a batch's CapturedBatch (the forward, or in the bench
    batches captured before). The forward runs in the caller, the writing on `writer_threads`
    threads (0: inline), see ShardWriters."""
    writers = ShardWriters(writer_threads, on_written=on_written)
    try:
        for number in numbers:
            writer = writers.open(out_dir / shard_name(number), feature_dtype=feature_dtype, feature_width=plan.feature_width,
                                  top_k=plan.top_k)
            for batch_indices in plan.shards[number]:
                batch = [sequences[i] for i in batch_indices]
                writers.write(writer, batch, produce(batch))
            writers.close(writer)
        writers.finish()
    except BaseException:
        writers.abort()
        raise


def write_shards(numbers: list[int], plan: "SplitPlan", sequences: list[Sequence], *, split: str, out_dir: Path, model, tap,
                 feature_dtype: str, pad_id: int, show_progress: bool, writer_threads: int | None = None) -> None:
    """Capture and write the given shards: the device runs batch n + 1 while writer threads
    encode, hash and write earlier batches, one shard per thread (`default_writer_threads` when
    `writer_threads` is None; 0 writes inline). The shards' bytes are the same for any count."""
    from dflash_pipeline.foundation.progress import progress

    bar = progress(total=sum(plan.shard_tokens[n] for n in numbers), unit="tok", unit_scale=True, desc=f"capture {split}",
                   disable=not show_progress or not numbers)
    if writer_threads is None:
        writer_threads = default_writer_threads(model_device(model).type)
    try:
        write_planned_shards(numbers, plan, sequences, out_dir=out_dir, feature_dtype=feature_dtype, writer_threads=writer_threads,
                             on_written=bar.update,
                             produce=lambda batch: capture_batch(model, tap, batch, pad_id=pad_id, top_k=plan.top_k,
                                                                 feature_dtype=feature_dtype))
    finally:
        bar.close()
