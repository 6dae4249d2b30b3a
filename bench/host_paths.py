"""Benchmark: the host work of a GPU train step and of a capture batch, before and after issue #27,
side by side at the GPU bench's shapes (no GPU needed: this is the part a GPU waits for).

    python bench/host_paths.py [--steps 3] [--tokens-per-step 16384] [--block-size 16]

Train: synthetic sequences of the bench's shapes (lengths 60-376, 5 taps x 576 bf16 features),
packed to `--tokens-per-step` context tokens with 16 anchors per sequence; the per-anchor
`build_batch` with its dense [Q, C + Q] mask (tests/oracles/blocks.py, the code before) against
the vectorised one, which carries ~10 bytes of metadata per key and block, and the flex BlockMask
built from that metadata. Capture: 64 sequences written through the element-by-element writer
(tests/oracles/shard_writer.py) and through the zero-copy writer that hashes as it writes. Prints
times, bytes and ratios; writes bench/results/host_paths.json.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the reference implementations live beside the tests that pin them


def _samples(count: int, width: int, seed: int = 0):
    import torch

    from dflash_pipeline.data.shards import Sample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for number in range(count):
        length = int(torch.randint(60, 377, (1,), generator=generator))
        prompt = int(torch.randint(10, max(11, length // 3), (1,), generator=generator))
        mask = torch.cat([torch.zeros(prompt, dtype=torch.uint8), torch.ones(length - prompt, dtype=torch.uint8)])
        ids = torch.randint(3, 49152, (length,), generator=generator, dtype=torch.int32)
        samples.append(Sample(f"s{number}", ids, mask, ids, torch.randn(length, width, generator=generator).to(torch.bfloat16)))
    return samples


def _best_of(function, repeats: int) -> tuple[object, float]:
    best, result = float("inf"), None
    for _ in range(repeats):
        began = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - began)
    return result, best


@click.command()
@click.option("--steps", default=3, show_default=True, help="Steps timed (best of) per variant.")
@click.option("--tokens-per-step", default=16384, show_default=True)
@click.option("--block-size", default=16, show_default=True)
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=ROOT / "bench" / "results" / "host_paths.json", show_default=True)
def main(steps, tokens_per_step, block_size, out_path):
    import torch

    from dflash_pipeline.data.blocks import build_batch
    from dflash_pipeline.foundation.devices import machine_description
    from dflash_pipeline.data.shards import ShardWriter
    from oracles.blocks import per_anchor_build_batch
    from oracles.shard_writer import ElementwiseShardWriter

    width = 5 * 576
    samples, packed, tokens = _samples(400, width), [], 0
    for sample in samples:
        if tokens + sample.input_ids.shape[0] > tokens_per_step:
            break
        packed.append(sample)
        tokens += sample.input_ids.shape[0]
    settings = dict(anchors_per_sequence=16, block_size=block_size, mask_token_id=0, anchor_seeds=list(range(len(packed))))
    old, old_s = _best_of(lambda: per_anchor_build_batch(packed, **settings), steps)
    new, new_s = _best_of(lambda: build_batch(packed, **settings), steps)
    _, block_mask_s = _best_of(lambda: new.block_mask(), steps)
    _, dense_s = _best_of(lambda: new.dense_mask(), steps)
    equal = all(torch.equal(getattr(new, key), old[key]) for key in ("block_ids", "block_positions", "labels", "exists", "context_positions"))
    metadata_bytes = sum(t.numel() * t.element_size() for t in (new.context_positions, new.context_sequence, new.block_sequence, new.block_positions))
    mask_bytes = old["mask"].numel()
    train = {"sequences": len(packed), "context_tokens": tokens, "blocks": int(new.block_sequence.shape[0]),
             "per_anchor_with_dense_mask_ms": round(old_s * 1e3, 1), "vectorised_ms": round(new_s * 1e3, 1),
             "block_mask_from_metadata_ms": round(block_mask_s * 1e3, 1), "dense_mask_from_metadata_ms": round(dense_s * 1e3, 1),
             "speedup_batch_building": round(old_s / new_s, 1), "dense_mask_mb": round(mask_bytes / 2**20, 1),
             "metadata_kb": round(metadata_bytes / 2**10, 1), "tensors_equal": equal}
    print(f"train step of {tokens} context tokens, {len(packed)} sequences, {train['blocks']} blocks of {block_size}:")
    print(f"  per-anchor build_batch + dense mask ({train['dense_mask_mb']} MB): {train['per_anchor_with_dense_mask_ms']} ms")
    print(f"  vectorised build_batch, mask as {train['metadata_kb']} KB of metadata: {train['vectorised_ms']} ms "
          f"-> {train['speedup_batch_building']}x; tensors equal: {equal}")
    print(f"  flex BlockMask from the metadata: {train['block_mask_from_metadata_ms']} ms (on a GPU: on the device); "
          f"the dense mask from it for CPU SDPA: {train['dense_mask_from_metadata_ms']} ms")

    rows = _samples(64, width, seed=1)
    with tempfile.TemporaryDirectory() as folder:
        times = {}
        for name, writer_class in (("element by element", ElementwiseShardWriter), ("zero-copy, hashed while written", ShardWriter)):
            def write():
                writer = writer_class(Path(folder) / f"{len(times)}.arrow", feature_dtype="bf16", feature_width=width)
                for row in rows:
                    writer.write(row.sequence_id, row.input_ids.numpy(), row.loss_mask.numpy(), row.target_next.numpy(), row.features)
                return writer.close()
            times[name] = _best_of(write, steps)
        (old_info, old_w), (new_info, new_w) = times.values()
    written = sum(row.input_ids.shape[0] for row in rows)
    capture = {"tokens": written, "elementwise_us_per_token": round(old_w / written * 1e6, 2), "zero_copy_us_per_token": round(new_w / written * 1e6, 2),
               "speedup": round(old_w / new_w, 2), "same_sha256": old_info.sha256 == new_info.sha256}
    print(f"capture writer, {written} tokens x {width} bf16 features: {capture['elementwise_us_per_token']} -> "
          f"{capture['zero_copy_us_per_token']} us/token ({capture['speedup']}x), same sha256: {capture['same_sha256']}")
    record = {"machine": f"{machine_description()}, torch threads {torch.get_num_threads()}",
              "date": time.strftime("%Y-%m-%d"), "train": train, "capture_writer": capture}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
