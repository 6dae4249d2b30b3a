"""The capture figures, on whatever device: the GPU path against the forward, the writer against the disk.

    python bench/gpu/capture_figures.py --dry-run                  # CPU, the tiny random target, toy sizes
    python bench/gpu/capture_figures.py --target data/target/target.json --generated data/generated/train.parquet

The capture goal is min(forward, disk): capture tokens/s >= 0.9 x min(plain forward tokens/s,
disk GB/s / bytes per token) (docs/gpu.md). `capture_figures` measures, in one process on the
same batches, each term apart, so a miss says which part is short:

  forward      the target without anything capture adds (see `forward_seconds`);
  GPU path     `capture.forward.capture_batch` + `CapturedBatch.wait`: forward, taps, chunked head, top-k,
               device-side conversion and the pinned host copies, no writer;
  writer       the stage's own writer (`capture.writers.write_planned_shards`) on batches captured before:
               encode, sha256, write and one fsync per shard, with N writer threads, in GB/s;
  disk         a plain sequential write of `disk_mb` MiB with fsync in the same folder, in GB/s;
  stage        `capture.writers.write_shards` end to end (GPU path and writer overlapped), tokens/s.

bench/gpu/figures.py calls `capture_figures(model, plan, sequences, layer_ids, pad_id=..., feature_dtype=...,
folder=...)` with the model it loaded and a `capture.SplitPlan`; tests/capture/test_writers.py runs
it on the tiny target on the CPU, tests/bench/test_dry_runs.py the dry run.
"""

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "src")]  # a lent GPU runs a plain checkout, the package not installed

from bench.toy import toy_run  # noqa: E402

GB = 1e9


def _device(model) -> str:
    return str(next(model.parameters()).device)


def _padded(batch, pad_id: int, device: str):
    import torch

    width = max(len(s.input_ids) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    for row, sequence in enumerate(batch):
        ids[row, : len(sequence.input_ids)] = torch.tensor(sequence.input_ids)
    return ids.to(device)


def forward_seconds(model, batches, *, pad_id: int, top_k: int, logits_chunk: int = 2048) -> float:
    """Seconds of the plain forward over `batches`: the base model (`model.get_decoder()`) to its
    last hidden state, then the stage's own chunked head (`capture.forward._head_outputs`: argmax and
    top-k per chunk of positions), with no taps and nothing copied to the host.

    The head is kept because every capture needs the target's next tokens and its top-k; it is
    a sizeable share of a small target's FLOPs (SmolLM2-135M: 576 x 49,152 per token), so a base
    model alone would be a baseline no capture could reach. The full `model(...)` is not used:
    it materialises [tokens, vocab] logits (6.4 GB at 65K tokens, 12.9 GB more as fp32), which
    the stage never does and which slows the baseline, flattering the ratio."""
    import torch

    from dflash_pipeline.capture.forward import _head_outputs
    from dflash_pipeline.foundation.devices import timed

    device = _device(model)

    @torch.inference_mode()
    def run():
        for batch in batches:
            hidden = model.get_decoder()(input_ids=_padded(batch, pad_id, device), use_cache=False).last_hidden_state
            _head_outputs(model, hidden.reshape(-1, hidden.shape[-1]), top_k=top_k, logits_chunk=logits_chunk)

    return timed(run, device)[1]


def gpu_path(model, tap, batches, *, pad_id: int, top_k: int, feature_dtype: str) -> tuple[list, float]:
    """(captured batches, seconds) of `capture_batch` + `wait` over `batches`, no writer: the
    stage's forward -> host copy path alone. The batches stay in host memory for `writer_seconds`."""
    from dflash_pipeline.capture.forward import capture_batch
    from dflash_pipeline.foundation.devices import timed

    def run():
        captured = [capture_batch(model, tap, batch, pad_id=pad_id, top_k=top_k, feature_dtype=feature_dtype) for batch in batches]
        return [batch.wait() for batch in captured]

    return timed(run, _device(model))


def writer_seconds(plan, sequences, numbers: list[int], captured_by_batch: dict, *, folder: Path, feature_dtype: str,
                   writer_threads: int) -> tuple[float, int]:
    """(seconds, bytes written) of the stage's writer writing shards `numbers` of `plan` into a
    fresh subfolder of `folder` (removed after) from batches captured before
    (`captured_by_batch`: tuple of sequence ids -> CapturedBatch), with `writer_threads` threads."""
    from dflash_pipeline.capture.writers import write_planned_shards

    out = Path(tempfile.mkdtemp(prefix="writer-", dir=folder))
    try:
        started = time.perf_counter()
        write_planned_shards(numbers, plan, sequences, out_dir=out, feature_dtype=feature_dtype, writer_threads=writer_threads,
                             produce=lambda batch: captured_by_batch[tuple(s.id for s in batch)])
        seconds = time.perf_counter() - started
        return seconds, sum(path.stat().st_size for path in out.glob("shard-*.arrow"))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def disk_write_gb_per_s(folder: Path, *, megabytes: int = 256, chunk_mb: int = 8) -> float:
    """Sequential write speed of the disk under `folder`: `megabytes` MiB in `chunk_mb` MiB
    writes, then fsync (as a shard is written), timed together; the file is removed after.
    The bytes are random, so a compressing file system does not flatter the figure."""
    chunk = os.urandom(chunk_mb << 20)
    path = Path(folder) / f".disk-write-{os.getpid()}.bin"
    try:
        started = time.perf_counter()
        with open(path, "wb", buffering=0) as file:
            for _ in range(max(1, megabytes // chunk_mb)):
                file.write(chunk)
            os.fsync(file.fileno())
        seconds = time.perf_counter() - started
        return max(1, megabytes // chunk_mb) * len(chunk) / seconds / GB
    finally:
        path.unlink(missing_ok=True)


def first_shards(plan, max_batches: int) -> list[int]:
    """The shard numbers of `plan` that hold its first `max_batches` batches (whole shards; at
    least one), so the writer sees the stage's real shard boundaries."""
    numbers, count = [], 0
    for number, shard in enumerate(plan.shards):
        if numbers and count + len(shard) > max_batches:
            break
        numbers.append(number)
        count += len(shard)
    return numbers


def capture_figures(model, plan, sequences, layer_ids: list[int], *, pad_id: int, feature_dtype: str, folder: Path,
                    writer_threads: int | None = None, max_batches: int = 4, disk_mb: int = 256, stage: bool = True) -> dict:
    """The capture figures of `model` on the first shards of `plan` (`first_shards`), one warm-up
    of each part first. `folder` is where shards and the disk probe are written (the stage's
    output disk); everything written there is removed. `writer_threads` None: the stage's default
    for the model's device. Keys: see the module docstring; all rates are per second, GB = 1e9 B."""
    from dflash_pipeline.capture.writers import write_shards, default_writer_threads
    from dflash_pipeline.foundation.devices import timed
    from dflash_pipeline.target.load import LayerTap

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    device = _device(model)
    if writer_threads is None:
        writer_threads = default_writer_threads(next(model.parameters()).device.type)
    numbers = first_shards(plan, max_batches)
    batches = [[sequences[i] for i in batch] for number in numbers for batch in plan.shards[number]]
    tokens = sum(plan.shard_tokens[n] for n in numbers)

    forward_seconds(model, batches[:1], pad_id=pad_id, top_k=plan.top_k)  # warm-up: kernels, allocator
    forward_s = forward_seconds(model, batches, pad_id=pad_id, top_k=plan.top_k)
    tap = LayerTap(model, layer_ids)
    try:
        gpu_path(model, tap, batches[:1], pad_id=pad_id, top_k=plan.top_k, feature_dtype=feature_dtype)
        captured, gpu_s = gpu_path(model, tap, batches, pad_id=pad_id, top_k=plan.top_k, feature_dtype=feature_dtype)
        by_batch = {tuple(s.id for s in batch): out for batch, out in zip(batches, captured)}
        writer_seconds(plan, sequences, numbers[:1], by_batch, folder=folder, feature_dtype=feature_dtype, writer_threads=writer_threads)
        write_s, written = writer_seconds(plan, sequences, numbers, by_batch, folder=folder, feature_dtype=feature_dtype,
                                          writer_threads=writer_threads)
        del captured, by_batch  # the host copies: the stage run below makes its own
        stage_s = None
        if stage:
            out = Path(tempfile.mkdtemp(prefix="stage-", dir=folder))
            try:
                _, stage_s = timed(lambda: write_shards(numbers, plan, sequences, split="bench", out_dir=out, model=model, tap=tap,
                                                        feature_dtype=feature_dtype, pad_id=pad_id, show_progress=False,
                                                        writer_threads=writer_threads), device)
            finally:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        tap.remove()
    disk = disk_write_gb_per_s(folder, megabytes=disk_mb)
    bytes_per_token = written / tokens
    forward_rate, disk_rate = tokens / forward_s, disk * GB / bytes_per_token
    figures = {
        "capture_figures_tokens": tokens,
        "capture_figures_batches": len(batches),
        "capture_figures_shards": len(numbers),
        "shard_bytes_per_token": round(bytes_per_token, 1),
        "forward_tokens_per_s": round(forward_rate, 1),
        "capture_gpu_path_tokens_per_s": round(tokens / gpu_s, 1),
        "capture_gpu_path_vs_forward": round(forward_s / gpu_s, 3),
        "writer_threads": writer_threads,
        "writer_gb_per_s": round(written / write_s / GB, 4),
        "writer_tokens_per_s": round(tokens / write_s, 1),
        "disk_write_gb_per_s": round(disk, 4),
        "disk_tokens_per_s": round(disk_rate, 1),
        "writer_vs_disk": round(written / write_s / GB / disk, 3),
        "capture_bound_tokens_per_s": round(min(forward_rate, disk_rate), 1),
    }
    if stage_s is not None:
        figures["capture_stage_tokens_per_s"] = round(tokens / stage_s, 1)
        figures["capture_stage_vs_bound"] = round(tokens / stage_s / min(forward_rate, disk_rate), 3)  # goal >= 0.9
    return figures


@click.command()
@click.option("--dry-run", is_flag=True, help="CPU, the toy run's tiny random target and fabricated answers (bench/toy.py), toy sizes.")
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--generated", type=click.Path(path_type=Path), default="data/generated/train.parquet", show_default=True)
@click.option("--device", default=None, help="Default: cuda when available, else cpu.")
@click.option("--writer-threads", type=int, default=None, help="Default: the stage's default for the device.")
@click.option("--max-batches", default=4, show_default=True)
@click.option("--disk-mb", default=256, show_default=True)
@click.option("--folder", type=click.Path(path_type=Path), default=None, help="Where shards are written (default: a temp dir).")
def main(dry_run, target_json, generated, device, writer_threads, max_batches, disk_mb, folder):
    import json
    from dataclasses import replace

    import torch

    from dflash_pipeline.capture.plan import SplitPlan, load_sequences, resolve_layer_ids
    from dflash_pipeline.foundation.config import CaptureConfig
    from dflash_pipeline.target.load import TargetInfo, load_target

    device = device or ("cuda" if torch.cuda.is_available() and not dry_run else "cpu")
    folder = Path(folder or tempfile.mkdtemp(prefix="capture-figures-"))
    config = CaptureConfig()
    if dry_run:  # the toy run's target and answers (in --folder, reused when there), batches of a few sequences
        toy = toy_run(folder, upto="generated")
        target_json, generated = toy.target_json, toy.generated / "train.parquet"
        config, disk_mb = replace(config, layer_ids=[0, 1, 2, 3], shard_mb=1, batch_tokens=256), min(disk_mb, 16)
    elif device.startswith("cuda"):
        config = replace(config, batch_tokens=max(config.batch_tokens, 65536))  # the GPU's batch (docs/gpu.md)
    target = TargetInfo.from_json(target_json)
    model, tokenizer = load_target(target, device=device)
    sequences, _ = load_sequences(generated, max_length=config.max_length, on_too_long="truncate")
    layer_ids = resolve_layer_ids(config, target.num_layers)
    plan = SplitPlan.make(sequences, config=config, target=target, layer_ids=layer_ids,
                          compute_dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    figures = capture_figures(model, plan, sequences, layer_ids, pad_id=pad_id, feature_dtype=config.feature_dtype, folder=folder,
                              writer_threads=writer_threads, max_batches=max_batches, disk_mb=disk_mb)
    print(json.dumps({"device": device, **figures}, indent=1))


if __name__ == "__main__":
    main()
