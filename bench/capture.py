"""Benchmark: capture cost, shard overhead, and reading shards vs one torch.save file per sample.

    python bench/capture.py [--sequences 64] [--rounds 2]
    python bench/capture.py --dry-run      # the tiny random target, 8 fabricated sequences (tests/bench/test_dry_runs.py)

Needs the `target` and `generate` stages' outputs (dvc repro generate). Everything is measured in
this one process, side by side, on the default target and the first --sequences generated train
sequences:

1. capture vs a plain no_grad forward (full logits) on the same length-sorted batches, the two
   alternating round by round; capture includes hooks, the LM-head argmax, bf16 conversion, the
   Arrow write, fsync and sha256 of the finished shard;
2. shard bytes / raw payload bytes (features + ids + next tokens + mask);
3. reading every sample (all of its bytes, copied into a training staging buffer, in a shuffled
   order) from the
   shards vs from one torch.save file per sample (the reference trainer's layout), same data, both
   from a warm page cache; and the time to the first sample for 1x and 10x datasets.
"""

import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `bench.*` from a plain `python bench/...`

from bench.toy import dry_run_options, toy_run  # noqa: E402


def _plain_forward(model, batches, pad_id):
    import torch

    for batch in batches:
        width = max(len(s.input_ids) for s in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, sequence in enumerate(batch):
            ids[row, : len(sequence.input_ids)] = torch.tensor(sequence.input_ids)
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)


def _capture(model, tap, batches, pad_id, folder: Path, width: int):
    from dflash_pipeline.capture.forward import forward_batch
    from dflash_pipeline.data.shards import ShardWriter

    writer = ShardWriter(folder / "shard-00000.arrow", feature_dtype="bf16", feature_width=width)
    for batch in batches:
        for sequence, out in zip(batch, forward_batch(model, tap, batch, pad_id=pad_id)):
            writer.write(sequence.id, sequence.input_ids, sequence.loss_mask, out.target_next.numpy(), out.features)
    return writer.close()


def _write_split(samples, folder: Path, width: int, copies: int = 1):
    from dflash_pipeline.data.shards import Manifest, ShardWriter

    folder.mkdir(parents=True)
    writer = ShardWriter(folder / "shard-00000.arrow", feature_dtype="bf16", feature_width=width)
    for copy in range(copies):
        for sample in samples:
            writer.write(f"{sample.sequence_id}-{copy}", sample.input_ids, sample.loss_mask, sample.target_next, sample.features)
    info = writer.close()
    Manifest(split="train", target_fingerprint="bench", layer_ids=[], hidden_size=0, num_target_layers=0, feature_dtype="bf16",
             feature_width=width, sequences=info.sequences, tokens=info.tokens, loss_tokens=0, shards=[info]).save(folder)


def _write_per_file(samples, folder: Path, copies: int = 1):
    import torch

    folder.mkdir(parents=True)
    for copy in range(copies):
        for index, sample in enumerate(samples):
            torch.save(
                {"input_ids": sample.input_ids.clone(), "loss_mask": sample.loss_mask.clone(),
                 "target_next": sample.target_next.clone(), "hidden_states": sample.features.clone()},
                folder / f"data_{copy * len(samples) + index:08d}.ckpt",
            )


def _staging(rows: int = 4096, width: int = 2880):
    import torch

    return torch.empty(rows, width, dtype=torch.bfloat16), torch.empty(rows, dtype=torch.long)


def _read_all_shards(folder: Path, order, staging=None):
    """Each sample as tensors; with `staging`, its features and ids also copied into a buffer
    (every byte read, as a GPU trainer's host-to-device staging does). Without it the samples
    are zero-copy views of the mapped shard, which is what the CPU trainer consumes: its `fc`
    projects each sequence's view directly (`DFlashDrafter.project_context`)."""
    from dflash_pipeline.data.shards import open_split

    dataset = open_split(folder, verify="none")
    for index in order:
        sample = dataset[index]
        if staging is not None:
            length = sample.features.shape[0]
            staging[0][:length].copy_(sample.features)
            staging[1][:length].copy_(sample.input_ids)


def _read_all_files(folder: Path, order, staging=None):
    """The same from one torch.save file per sample, listed the way a directory dataset does."""
    import torch

    files = sorted(folder.iterdir())
    for index in order:
        data = torch.load(files[index], weights_only=True)
        if staging is not None:
            length = data["hidden_states"].shape[0]
            staging[0][:length].copy_(data["hidden_states"])
            staging[1][:length].copy_(data["input_ids"])


def _first_sample_seconds(read_first) -> float:
    from dflash_pipeline.foundation.devices import timed

    return timed(read_first, "cpu")[1]


@click.command()
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--generated", type=click.Path(path_type=Path), default="data/generated/train.parquet", show_default=True)
@click.option("--sequences", "count", default=64, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--scratch", type=click.Path(path_type=Path), default=None, help="Scratch folder (default: a temp dir).")
@dry_run_options
def main(target_json, generated, count, rounds, scratch, dry_run, work):
    import torch

    from dflash_pipeline.capture.plan import load_sequences, plan_shards
    from dflash_pipeline.foundation.devices import timed
    from dflash_pipeline.target.load import LayerTap, build_target_layer_ids
    from dflash_pipeline.foundation.files import sha256_file
    from dflash_pipeline.data.shards import bytes_per_token, open_split
    from dflash_pipeline.target.load import TargetInfo, load_target

    if dry_run:
        toy = toy_run(work, upto="generated")
        target_json, generated, count, rounds = toy.target_json, toy.generated / "train.parquet", 8, 1
    info = TargetInfo.from_json(target_json)
    model, tokenizer = load_target(info)
    device = next(model.parameters()).device
    sequences, _ = load_sequences(generated, max_length=2048, on_too_long="truncate")
    sequences = sequences[:count]
    layer_ids = build_target_layer_ids(info.num_layers, 5)
    width = len(layer_ids) * info.hidden_size
    plan = plan_shards(sequences, token_bytes=bytes_per_token(width, "bf16"), shard_bytes=1 << 40, batch_tokens=8192)
    batches = [[sequences[i] for i in batch] for batch in plan[0]]
    tokens = sum(len(s.input_ids) for s in sequences)
    pad_id = tokenizer.pad_token_id or 0
    scratch = Path(scratch or tempfile.mkdtemp(prefix="bench-capture-"))
    print(f"{len(sequences)} sequences, {tokens:,} tokens, {len(batches)} batches; taps {layer_ids}; torch threads {torch.get_num_threads()}")

    tap = LayerTap(model, layer_ids)
    _plain_forward(model, batches[-1:], pad_id)  # warm-up
    times = {"plain": 0.0, "capture": 0.0}
    for round_index in range(rounds):
        tap.remove()
        times["plain"] += timed(lambda: _plain_forward(model, batches, pad_id), device)[1]
        tap = LayerTap(model, layer_ids)
        folder = scratch / f"capture-{round_index}"
        folder.mkdir(parents=True, exist_ok=True)
        shard, seconds = timed(lambda: _capture(model, tap, batches, pad_id, folder, width), device)
        times["capture"] += seconds
        print(f"round {round_index + 1}: plain {tokens / (times['plain'] / (round_index + 1)):.0f} tok/s, "
              f"capture {tokens / (times['capture'] / (round_index + 1)):.0f} tok/s")
    tap.remove()
    plain_rate, capture_rate = tokens * rounds / times["plain"], tokens * rounds / times["capture"]
    print(f"1. capture {capture_rate:.0f} tok/s / plain forward {plain_rate:.0f} tok/s = {capture_rate / plain_rate:.3f} (goal >= 0.90)")
    payload = tokens * bytes_per_token(width, "bf16")
    print(f"2. shard bytes {shard.bytes:,} / payload {payload:,} = {shard.bytes / payload:.4f} (goal <= 1.02)")

    # 3. Reading, same data in both layouts.
    from dflash_pipeline.data.shards import Manifest

    split = scratch / "split-1x"
    shutil.copytree(scratch / "capture-0", split)
    Manifest(split="train", target_fingerprint="bench", layer_ids=layer_ids, hidden_size=info.hidden_size,
             num_target_layers=info.num_layers, feature_dtype="bf16", feature_width=width, sequences=shard.sequences,
             tokens=shard.tokens, loss_tokens=0, shards=[shard]).save(split)
    dataset = open_split(split)
    samples = [dataset[i] for i in range(len(dataset))]
    _write_per_file(samples, scratch / "files-1x")
    order = list(range(len(samples)))
    random.Random(0).shuffle(order)
    staging = _staging(rows=max(len(s.input_ids) for s in samples), width=width)
    _read_all_shards(split, order, staging)  # warm-up, untimed: imports, allocator, page cache
    _read_all_files(scratch / "files-1x", order, staging)
    for mode, buffer in (("as tensors", None), ("copied to a staging buffer", staging)):
        read = {"shards": 0.0, "files": 0.0}
        for _ in range(rounds):
            for name, reader, folder in (("shards", _read_all_shards, split), ("files", _read_all_files, scratch / "files-1x")):
                started = time.perf_counter()
                reader(folder, order, buffer)
                read[name] += time.perf_counter() - started
        print(f"3. read all {len(samples)} samples {mode}: shards {read['shards'] / rounds * 1e3:.1f} ms, per-sample files "
              f"{read['files'] / rounds * 1e3:.1f} ms; shards {read['files'] / read['shards']:.1f}x faster (goal >= 5x)")

    _write_split(samples, scratch / "split-10x", width, copies=10)
    _write_per_file(samples, scratch / "files-10x", copies=10)
    first = {}
    for size in ("1x", "10x"):
        first[("shards", size)] = min(_first_sample_seconds(lambda: _read_all_shards(scratch / f"split-{size}", [0], staging)) for _ in range(3))
        first[("files", size)] = min(_first_sample_seconds(lambda: _read_all_files(scratch / f"files-{size}", [0], staging)) for _ in range(3))
    print(f"   time to first sample, 1x -> 10x dataset: shards {first[('shards', '1x')] * 1e3:.2f} -> {first[('shards', '10x')] * 1e3:.2f} ms "
          f"(x{first[('shards', '10x')] / first[('shards', '1x')]:.2f}); per-sample files {first[('files', '1x')] * 1e3:.2f} -> "
          f"{first[('files', '10x')] * 1e3:.2f} ms (x{first[('files', '10x')] / first[('files', '1x')]:.2f})")
    started = time.perf_counter()
    sha256_file(scratch / "split-10x" / "shard-00000.arrow")
    size = (scratch / "split-10x" / "shard-00000.arrow").stat().st_size
    print(f"   (full verification hashes shards at {size / (time.perf_counter() - started) / 2**20:.0f} MiB/s, once per stage run)")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
