"""Stage `capture`: one target forward per sequence; selected layers' outputs into Arrow shards.

Input: `data/generated/{train,val}.parquet` (exact token ids from `generate`) and the target.
Output per split: `shard-NNNNN.arrow` files and `manifest.json` (format in `shards.py`), plus
`capture.json`, the settings and plan the shards were made with. `run_capture` returns a summary
whose `this_run` part (seconds, shards written now) is the only part that differs between two
runs on the same inputs; the stage script writes it as a metrics file outside the data folder,
so a rerun that changes no shard leaves the output, and every stage after it, unchanged.

Layer id i means the OUTPUT of decoder layer i (`target.LayerTap`): forward hooks keep only the
selected layers, never all L + 1 hidden states.

The work is planned before it starts: sequences sorted by length, cut into shards of about
`shard_mb`, each shard cut into batches of at most `batch_tokens` padded tokens. The plan alone
decides what goes where, so a rerun after kill -9 skips the shards already renamed into place
and rewrites the rest byte for byte the same, and under torchrun rank r simply takes shards
r, r + world, ... of the same plan (rank 0 writes the manifests once all ranks are done).

The run works in `<out>.partial/` beside the output and renames it to `<out>` once both splits
are done: a killed run's shards wait there for the rerun, so the DVC output need not be
`persist`ed. That matters at scale: before rerunning a stage DVC copies every file of a persisted
output out of its cache (`dvc unprotect`, a full copy of the shards when they are hard links),
while a plain output is deleted, which only unlinks (bench/dvc_costs.py). A run outside DVC
that finds a finished `<out>` and no `.partial` starts from it, so its shards are reused as before.
When DVC serves `<out>` from its run cache instead of running the stage (a rerun after a kill, with
settings it has seen), a killed run's `.partial` stays behind: `make repro` removes it
(`dflash-pipeline verify --repair`, README "Recovery"). The pipeline cannot remove it on its own:
a run-cache restore runs none of our code; a folder inside `<out>` would be deleted by DVC before
every rerun of the stage, with the finished shards it is there to keep; and no stage is sure to
run after a restore (train is restored too when its inputs are), short of an `always_changed`
stage, which would make every `dvc status` report a change. Left alone it is still of use: a
later run with the settings that made it resumes from it.

A shard already there is kept only when its sha256 equals a record made when it was written:
its `.sha256` file (a run not finished yet) or the previous manifest (a finished one; both are
only ever left by a run of this same capture record, since other settings empty the folder).
Anything else, a flipped bit that Arrow still reads included, is rebuilt, and the run says so.
"""

import contextlib
import hashlib
import os
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from dflash_pipeline.foundation.config import CaptureConfig, as_dict
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import format_bytes, reuse_or_reset, sha256_file, staging_dir
from dflash_pipeline.data.prompts import read_generated
from dflash_pipeline.data.shards import (
    SHA256_SUFFIX,
    SHARD_GLOB,
    Manifest,
    ShardInfo,
    ShardWriter,
    bytes_per_token,
    recorded_sha256,
    sha256_record_path,
)
from dflash_pipeline.target.load import LayerTap, TargetInfo, build_target_layer_ids

SPLITS = ("train", "val")


def resolve_layer_ids(config: CaptureConfig, num_target_layers: int, *, source: str = "params.yaml") -> list[int]:
    """The target layers to tap; a choice this target cannot serve is one line naming `source` (the params file) and the key."""
    layer_ids = list(config.layer_ids) if config.layer_ids is not None else build_target_layer_ids(num_target_layers, config.num_layers)
    for layer_id in layer_ids:
        if not 0 <= layer_id < num_target_layers:
            raise PipelineError(f"{source}: key 'capture.layer_ids' must hold layers in 0..{num_target_layers - 1} for this target, "
                                f"got {layer_id}")
    if len(set(layer_ids)) != len(layer_ids):
        if config.layer_ids is None:
            raise PipelineError(
                f"{source}: key 'capture.num_layers' repeats layers {layer_ids} on a {num_target_layers}-layer target "
                f"(set capture.layer_ids explicitly), got {config.num_layers}"
            )
        raise PipelineError(f"{source}: key 'capture.layer_ids' repeats a layer, got {layer_ids}")
    return layer_ids


@dataclass(frozen=True)
class Sequence:
    id: str
    input_ids: list[int]
    loss_mask: list[int]


def load_sequences(path: Path, *, max_length: int, on_too_long: str) -> tuple[list[Sequence], Counter]:
    """Prompt + answer ids with the loss mask on the answer; odd rows are counted, not fatal."""
    stats: Counter = Counter()
    sequences = []
    for row in read_generated(path).to_pylist():
        prompt, answer = row["prompt_ids"], row["answer_ids"]
        stats["rows"] += 1
        if not answer:
            stats["skipped_empty_answer"] += 1
            continue
        if not prompt:
            stats["all_answer_tokens"] += 1  # kept: the mask is all ones, which training handles
        input_ids, loss_mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
        if len(input_ids) > max_length:
            if on_too_long == "skip":
                stats["skipped_too_long"] += 1
                continue
            input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
            stats["truncated"] += 1
            if sum(loss_mask) == 0:
                stats["skipped_no_answer_within_max_length"] += 1
                continue
        sequences.append(Sequence(row["prompt_id"], input_ids, loss_mask))
    return sequences, stats


def plan_shards(sequences: list[Sequence], *, token_bytes: int, shard_bytes: int, batch_tokens: int) -> list[list[list[int]]]:
    """Shards -> batches -> sequence indices, longest sequences first (memory peaks at once)."""
    order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i].input_ids), sequences[i].id))
    shards: list[list[list[int]]] = []
    shard: list[list[int]] = []
    batch: list[int] = []
    shard_size = 0
    for index in order:
        length = len(sequences[index].input_ids)
        # Padded size of the batch if this sequence joins it: the first (longest) sets the width.
        width = len(sequences[batch[0]].input_ids) if batch else length
        if batch and (len(batch) + 1) * width > batch_tokens:
            shard.append(batch)
            batch = []
        if shard_size and shard_size + length * token_bytes > shard_bytes:
            if batch:
                shard.append(batch)
                batch = []
            shards.append(shard)
            shard, shard_size = [], 0
        batch.append(index)
        shard_size += length * token_bytes
    if batch:
        shard.append(batch)
    if shard:
        shards.append(shard)
    return shards


class Captured(NamedTuple):
    """One sequence's capture: features [S, W], the target's greedy next token [S], and its
    `top_k` most probable next tokens [S, K] with their log-probabilities [S, K]."""

    features: "object"
    target_next: "object"
    topk_ids: "object"
    topk_logprobs: "object"


def _head_outputs(model, flat, *, top_k: int, logits_chunk: int):
    """Greedy next token, top-k ids and log-probs of every row of flat [T, H], chunk by chunk."""
    import torch

    argmax, ids, logprobs = [], [], []
    for start in range(0, flat.shape[0], logits_chunk):
        logits = model.lm_head(flat[start : start + logits_chunk]).float()
        argmax.append(logits.argmax(-1))
        if top_k:
            values, indices = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1, sorted=True)
            ids.append(indices)
            logprobs.append(values)
    empty = flat.new_zeros((flat.shape[0], 0))
    return (torch.cat(argmax), torch.cat(ids) if ids else empty.long(), torch.cat(logprobs) if logprobs else empty.float())


@dataclass
class CapturedBatch:
    """One padded batch's outputs on the host, one tensor per column (`rows` slices them per
    sequence as views). On a GPU each column came back in one non-blocking copy into pinned
    memory; `wait` blocks until those copies have landed (the one wait of a batch)."""

    lengths: list[int]
    features: "object"  # [rows, width, W]: bf16 when the shards store bf16, else the compute dtype
    target_next: "object"  # [rows, width] int32
    topk_ids: "object"  # [rows, width, K] int32
    topk_logprobs: "object"  # [rows, width, K] float32
    copied: "object" = None  # a CUDA event recorded after the copies, or None

    def wait(self) -> "CapturedBatch":
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        return self

    def rows(self) -> list["Captured"]:
        self.wait()
        return [Captured(self.features[row, :length], self.target_next[row, :length], self.topk_ids[row, :length],
                         self.topk_logprobs[row, :length]) for row, length in enumerate(self.lengths)]


def _to_host(tensor, dtype):
    """`tensor` as `dtype` on the host: itself on a CPU; on a GPU converted there, then one
    non-blocking copy into pinned memory (the caller waits on an event before reading it)."""
    import torch

    tensor = tensor.to(dtype)
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def capture_batch(model, tap: LayerTap, batch: list[Sequence], *, pad_id: int, top_k: int = 0, logits_chunk: int = 2048,
                  feature_dtype: str | None = None) -> CapturedBatch:
    """Run one right-padded batch; its outputs start on their way to the host (see CapturedBatch).

    Right padding needs no attention mask: with causal attention a real token never sees the
    padding after it. The LM head runs in chunks of positions, so [tokens, vocab] logits for the
    whole batch never exist at once. With `feature_dtype` "bf16" the features are rounded to bf16
    on the device (half the bytes to copy; the same rounding the writer would do).
    """
    import torch

    device = next(model.parameters()).device
    lengths = [len(s.input_ids) for s in batch]
    width = max(lengths)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    for row, sequence in enumerate(batch):
        input_ids[row, : lengths[row]] = torch.tensor(sequence.input_ids)
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=input_ids.to(device), use_cache=False).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        next_tokens, topk_ids, topk_logprobs = _head_outputs(model, flat, top_k=top_k, logits_chunk=logits_chunk)
        features = tap.features()
        result = CapturedBatch(
            lengths,
            _to_host(features, torch.bfloat16 if feature_dtype == "bf16" else features.dtype),
            _to_host(next_tokens.view(len(batch), width), torch.int32),
            _to_host(topk_ids.view(len(batch), width, top_k), torch.int32),
            _to_host(topk_logprobs.view(len(batch), width, top_k), torch.float32),
        )
        if device.type == "cuda":
            result.copied = torch.cuda.Event()
            result.copied.record()
    return result


def forward_batch(model, tap: LayerTap, batch: list[Sequence], *, pad_id: int, top_k: int = 0, logits_chunk: int = 2048) -> list[Captured]:
    """Run one right-padded batch; return each sequence's `Captured` outputs (on the host)."""
    return capture_batch(model, tap, batch, pad_id=pad_id, top_k=top_k, logits_chunk=logits_chunk).rows()


def capture_settings(config: CaptureConfig, target: TargetInfo, layer_ids: list[int], compute_dtype: str) -> dict:
    """Everything that changes the bytes of a shard; old shards are reused only when it matches."""
    return {
        "target_fingerprint": target.fingerprint,
        "layer_ids": layer_ids,
        "feature_dtype": config.feature_dtype,
        "target_top_k": config.target_top_k,
        "max_length": config.max_length,
        "on_too_long": config.on_too_long,
        "batch_tokens": config.batch_tokens,
        "shard_mb": config.shard_mb,
        "compute_dtype": compute_dtype,
    }


def _plan_digest(sequences: list[Sequence]) -> str:
    digest = hashlib.sha256()
    for sequence in sequences:
        digest.update(sequence.id.encode() + b":" + ",".join(map(str, sequence.input_ids)).encode() + b";")
        digest.update(bytes(sequence.loss_mask))
    return digest.hexdigest()


def _shard_name(number: int) -> str:
    return f"shard-{number:05d}.arrow"


def _previous_manifest_entries(out_dir: Path, split: str) -> dict[str, ShardInfo]:
    """Shard name -> its size and sha256 in the manifest an earlier run of this record finished."""
    if not (out_dir / "manifest.json").is_file():
        return {}
    try:
        return {info.file: info for info in Manifest.load(out_dir).shards}
    except PipelineError as exc:
        print(f"capture {split}: previous {exc}; shards without a .sha256 record are rebuilt")
        return {}


def _unverified_shard(path: Path, previous: ShardInfo | None) -> str | None:
    """Why the shard at `path` cannot be kept, or None when it matches its writer's record.

    The `.sha256` file comes first: it exists only for shards written after the last manifest,
    so it is the newer record of the two.
    """
    expected, source = recorded_sha256(path), sha256_record_path(path).name
    if expected is None and previous is not None:
        if path.stat().st_size != previous.bytes:
            return f"{path.stat().st_size} bytes, manifest.json says {previous.bytes}"
        expected, source = previous.sha256, "manifest.json"
    if expected is None:
        return "no recorded sha256 to check it against"
    if sha256_file(path) != expected:
        return f"sha256 differs from {source}"
    return None


def _drop_unverified_shards(out_dir: Path, split: str, count: int) -> None:
    """Remove every existing shard of the plan that does not match its record; print one line."""
    previous = _previous_manifest_entries(out_dir, split)
    dropped = []
    for number in range(count):
        path = out_dir / _shard_name(number)
        if not path.is_file():
            continue
        reason = _unverified_shard(path, previous.get(path.name))
        if reason is not None:
            path.unlink()
            sha256_record_path(path).unlink(missing_ok=True)
            dropped.append(f"{path.name} ({reason})")
    if dropped:
        shown = ", ".join(dropped[:3]) + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
        print(f"capture {split}: rebuilding {len(dropped)} shard(s) that do not match their recorded sha256: {shown}")


def _warmup_tokens_per_s(model, tap, sequences: list[Sequence], pad_id: int) -> float:
    """Time one small forward to estimate the run's duration before it starts."""
    sample = sorted(sequences, key=lambda s: len(s.input_ids))[: max(1, min(len(sequences), 4))]
    forward_batch(model, tap, sample, pad_id=pad_id)  # first call pays one-time costs
    started = time.perf_counter()
    forward_batch(model, tap, sample, pad_id=pad_id)
    return sum(len(s.input_ids) for s in sample) / max(time.perf_counter() - started, 1e-6)


@dataclass
class SplitPlan:
    """What goes where in one split: shards -> batches -> sequence indices, and their sizes."""

    shards: list[list[list[int]]]
    shard_sequences: list[int]
    shard_tokens: list[int]
    feature_width: int
    token_bytes: int
    top_k: int
    record: dict  # everything the shards' bytes depend on (capture.json)

    @classmethod
    def make(cls, sequences: list[Sequence], *, config: CaptureConfig, target: TargetInfo, layer_ids: list[int],
             compute_dtype: str) -> "SplitPlan":
        width = len(layer_ids) * target.hidden_size
        token_bytes = bytes_per_token(width, config.feature_dtype, config.target_top_k)
        shards = plan_shards(sequences, token_bytes=token_bytes, shard_bytes=config.shard_mb << 20, batch_tokens=config.batch_tokens)
        return cls(shards=shards, shard_sequences=[sum(len(batch) for batch in shard) for shard in shards],
                   shard_tokens=[sum(len(sequences[i].input_ids) for batch in shard for i in batch) for shard in shards],
                   feature_width=width, token_bytes=token_bytes, top_k=config.target_top_k,
                   record={"settings": capture_settings(config, target, layer_ids, compute_dtype), "plan_sha256": _plan_digest(sequences)})


def _prepare_split(plan: SplitPlan, sequences: list[Sequence], *, split: str, out_dir: Path, model, tap, config: CaptureConfig,
                   layer_ids: list[int], hidden_size: int, pad_id: int, world: int) -> list[int]:
    """Rank 0, before any rank writes: keep only verified shards of these settings, print the
    estimate, check the disk. Returns the shard numbers still to write."""
    dropped = reuse_or_reset(out_dir, "capture.json", plan.record, SHARD_GLOB)
    if dropped:
        print(f"capture {split}: inputs or settings changed; removed {dropped} old shard(s)")
    _drop_unverified_shards(out_dir, split, len(plan.shards))
    missing = [n for n in range(len(plan.shards)) if not (out_dir / _shard_name(n)).is_file()]
    missing_tokens = sum(plan.shard_tokens[n] for n in missing)
    total_tokens = sum(plan.shard_tokens)
    line = (
        f"capture {split}: {len(sequences)} sequences, {total_tokens:,} tokens in {len(plan.shards)} shard(s), "
        f"{len(plan.shards) - len(missing)} already done; layers {layer_ids} x {hidden_size} in {config.feature_dtype} "
        f"= {plan.token_bytes} B/token -> {format_bytes(total_tokens * plan.token_bytes)}"
    )
    if missing:
        rate = _warmup_tokens_per_s(model, tap, sequences, pad_id) * world
        line += f"; about {missing_tokens / rate / 60:.1f} min at {rate:.0f} tokens/s (warm-up batch)"
    print(line)
    needed, free = missing_tokens * plan.token_bytes, shutil.disk_usage(out_dir).free
    if needed * 1.02 > free:
        raise PipelineError(f"{out_dir}: capture needs about {format_bytes(needed)} for shards, only {format_bytes(free)} free on that disk")
    return missing


def default_writer_threads(device_type: str) -> int:
    """Writer threads when the caller names none: on a GPU up to 4 (one shard each; hashing and
    Arrow release the GIL, so they run in parallel and keep up with the device), on a CPU none,
    since a thread there takes cores from the forward (bench/capture_writers.py measures it)."""
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
            writer = writers.open(out_dir / _shard_name(number), feature_dtype=feature_dtype, feature_width=plan.feature_width,
                                  top_k=plan.top_k)
            for batch_indices in plan.shards[number]:
                batch = [sequences[i] for i in batch_indices]
                writers.write(writer, batch, produce(batch))
            writers.close(writer)
        writers.finish()
    except BaseException:
        writers.abort()
        raise


def _write_shards(numbers: list[int], plan: "SplitPlan", sequences: list[Sequence], *, split: str, out_dir: Path, model, tap,
                  feature_dtype: str, pad_id: int, show_progress: bool, writer_threads: int | None = None) -> None:
    """Capture and write the given shards: the device runs batch n + 1 while writer threads
    encode, hash and write earlier batches, one shard per thread (`default_writer_threads` when
    `writer_threads` is None; 0 writes inline). The shards' bytes are the same for any count."""
    from dflash_pipeline.foundation.progress import progress

    bar = progress(total=sum(plan.shard_tokens[n] for n in numbers), unit="tok", unit_scale=True, desc=f"capture {split}",
                   disable=not show_progress or not numbers)
    if writer_threads is None:
        writer_threads = default_writer_threads(next(model.parameters()).device.type)
    try:
        write_planned_shards(numbers, plan, sequences, out_dir=out_dir, feature_dtype=feature_dtype, writer_threads=writer_threads,
                             on_written=bar.update,
                             produce=lambda batch: capture_batch(model, tap, batch, pad_id=pad_id, top_k=plan.top_k,
                                                                 feature_dtype=feature_dtype))
    finally:
        bar.close()


def _write_manifest(plan: SplitPlan, sequences: list[Sequence], stats: Counter, *, split: str, out_dir: Path, target: TargetInfo,
                    layer_ids: list[int], feature_dtype: str) -> Manifest:
    shards = []
    for number in range(len(plan.shards)):
        path = out_dir / _shard_name(number)
        shards.append(ShardInfo(path.name, plan.shard_sequences[number], plan.shard_tokens[number], path.stat().st_size, sha256_file(path)))
    manifest = Manifest(
        split=split,
        target_fingerprint=target.fingerprint,
        layer_ids=layer_ids,
        hidden_size=target.hidden_size,
        num_target_layers=target.num_layers,
        feature_dtype=feature_dtype,
        feature_width=plan.feature_width,
        sequences=len(sequences),
        tokens=sum(plan.shard_tokens),
        loss_tokens=sum(sum(s.loss_mask) for s in sequences),
        shards=shards,
        stats=dict(stats),
        target_top_k=plan.top_k,
    )
    manifest.save(out_dir)
    # The manifest now records every shard's sha256; the per-shard records would only duplicate it.
    for record_file in out_dir.glob(SHARD_GLOB + SHA256_SUFFIX):
        record_file.unlink()
    return manifest


def capture_split(
    sequences: list[Sequence],
    stats: Counter,
    *,
    split: str,
    model,
    tap: LayerTap,
    target: TargetInfo,
    config: CaptureConfig,
    layer_ids: list[int],
    out_dir: Path,
    pad_id: int,
    rank: int = 0,
    world: int = 1,
    barrier=None,
    writer_threads: int | None = None,
) -> tuple[Manifest | None, dict]:
    """Capture one split into `out_dir`; return its manifest and what this run wrote (rank 0),
    or (None, {}) on other ranks. Rank r writes shards r, r + world, ... of the one plan."""
    compute_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    plan = SplitPlan.make(sequences, config=config, target=target, layer_ids=layer_ids, compute_dtype=compute_dtype)
    missing = []
    if rank == 0:
        missing = _prepare_split(plan, sequences, split=split, out_dir=out_dir, model=model, tap=tap, config=config,
                                 layer_ids=layer_ids, hidden_size=target.hidden_size, pad_id=pad_id, world=world)
    if barrier is not None:
        barrier()
    # Rank 0 removed every shard it could not verify before the barrier: what is there is kept.
    todo = [n for n in range(rank, len(plan.shards), world) if not (out_dir / _shard_name(n)).is_file()]
    _write_shards(todo, plan, sequences, split=split, out_dir=out_dir, model=model, tap=tap, feature_dtype=config.feature_dtype,
                  pad_id=pad_id, show_progress=rank == 0, writer_threads=writer_threads)
    if barrier is not None:
        barrier()
    if rank != 0:
        return None, {}
    absent = [n for n in range(len(plan.shards)) if not (out_dir / _shard_name(n)).is_file()]
    if absent:
        # Every rank has finished its shards: one rank 0 cannot see was written to another machine's disk.
        raise PipelineError(f"{out_dir / _shard_name(absent[0])}: written by rank {absent[0] % world} of {world} but not "
                            f"visible to rank 0 ({len(absent)} shard(s) absent); on several machines --out must be "
                            "a folder all nodes share")
    manifest = _write_manifest(plan, sequences, stats, split=split, out_dir=out_dir, target=target, layer_ids=layer_ids,
                               feature_dtype=config.feature_dtype)
    return manifest, {"shards_written": len(missing), "shards_kept": len(plan.shards) - len(missing),
                      "tokens_written": sum(plan.shard_tokens[n] for n in missing)}


def _adopt_finished_output(out_dir: Path, work_dir: Path) -> None:
    """Rank 0, before any rank writes: with no interrupted run to resume, a finished output (a run
    outside DVC; DVC deletes its own before the stage) becomes the starting point, moved, not copied.
    Files linked to the DVC cache stay safe: capture replaces files by rename, never edits one."""
    if out_dir.is_dir() and not work_dir.exists():
        os.replace(out_dir, work_dir)


def _publish(work_dir: Path, out_dir: Path) -> None:
    """Rank 0, after every rank finished: the whole output appears under its name in one rename."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(work_dir, out_dir)


def check_split_sizes(sequences: dict[str, list[Sequence]], stats: dict[str, Counter], generated_dir: Path) -> None:
    """Refuse, before any forward, a split left without a sequence: train has nothing to learn from,
    and the val split is what train and evaluate score (a one-prompt file gives 0 val prompts)."""
    for split in SPLITS:
        if not sequences[split]:
            counts = ", ".join(f"{key} {value}" for key, value in sorted(stats[split].items()) if key != "rows")
            raise PipelineError(f"capture: {generated_dir / (split + '.parquet')}: the {split} split has no sequence to capture "
                                f"({stats[split]['rows']} row(s){'; ' + counts if counts else ''}); rerun generate with more prompts")


def run_capture(config: CaptureConfig, *, target: TargetInfo, generated_dir: Path, out_dir: Path, device: str,
                source: str = "params.yaml", writer_threads: int | None = None) -> dict:
    """Capture both splits, single-process or as one rank of torchrun; return a summary (rank 0):
    what the shards hold under "splits", and this run's work and timings under "this_run".
    The work happens in `staging_dir(out_dir)`, renamed to `out_dir` at the end. `source`: the
    params file `config` came from, named in configuration errors. `writer_threads`: shards
    written at once (None: `default_writer_threads`); the shards' bytes do not depend on it."""
    import torch
    import torch.distributed as dist

    from dflash_pipeline.target.load import load_target

    config.validate_context(target.max_position_embeddings, source)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    barrier = None
    if world > 1:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
        barrier = dist.barrier
    try:
        layer_ids = resolve_layer_ids(config, target.num_layers, source=source)
        loaded = {split: load_sequences(generated_dir / f"{split}.parquet", max_length=config.max_length, on_too_long=config.on_too_long)
                  for split in SPLITS}
        check_split_sizes({split: pair[0] for split, pair in loaded.items()}, {split: pair[1] for split, pair in loaded.items()},
                          Path(generated_dir))
        model, tokenizer = load_target(target, device=device)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        tap = LayerTap(model, layer_ids)
        out_dir = Path(out_dir)
        work_dir = staging_dir(out_dir)
        if rank == 0:
            _adopt_finished_output(out_dir, work_dir)
        summary = {"layer_ids": layer_ids, "splits": {}, "this_run": {}}
        for split in SPLITS:
            sequences, stats = loaded[split]
            started = time.perf_counter()
            manifest, written = capture_split(
                sequences, stats, split=split, model=model, tap=tap, target=target, config=config,
                layer_ids=layer_ids, out_dir=work_dir / split, pad_id=pad_id, rank=rank, world=world, barrier=barrier,
                writer_threads=writer_threads,
            )
            if manifest is not None:
                seconds = time.perf_counter() - started
                summary["splits"][split] = {
                    "sequences": manifest.sequences,
                    "tokens": manifest.tokens,
                    "loss_tokens": manifest.loss_tokens,
                    "shards": len(manifest.shards),
                    "bytes": sum(s.bytes for s in manifest.shards),
                    "stats": manifest.stats,
                }
                summary["this_run"][split] = {
                    **written,
                    "seconds": round(seconds, 2),
                    "tokens_per_s": round(written["tokens_written"] / seconds, 1) if written["tokens_written"] else None,
                }
        tap.remove()
        if rank == 0:
            _publish(work_dir, out_dir)
        summary["config"] = as_dict(config)
        return summary
    finally:
        if world > 1:
            dist.destroy_process_group()
