"""Benchmark: capture's writer threads against today's writer, side by side on the CPU, same batches.

    python bench/capture_writers.py [--target data/target/target.json] [--generated data/generated/train.parquet]
                                    [--sequences 32] [--rounds 2] [--shard-mb 32] [--json out.json]

Without `data/generated` (DVC outputs not checked out) `--fabricate` writes answers with the GPU
bench's `fabricate_generated` (random ids: capture's cost does not depend on what they say).
"Before" is the capture module of `--baseline-ref` (default main), loaded from git into this
process, so both run on the same model, batches and disk, in alternating rounds (each variant
first in turn):

1. the stage's write path, `write_shards` (forward, taps, head, and the writing), before vs after
   at the default writer count for the device (inline on a CPU, as before) and with 2 threads;
   the shards of every variant are checked byte-identical;
2. the writer alone (`write_planned_shards` on batches captured once): 0 (inline), 1 (today's
   GPU scheme) and 2 threads, in GB/s.
`--shard-mb` is smaller than the stage's 256 so that the sample holds several shards to share.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))
sys.path.insert(1, str(REPO_ROOT / "bench"))


def baseline_write_shards(ref: str, scratch: Path):
    """The stage's write path (`write_shards`) as it is at git `ref`, from the module that holds it
    there (capture/writers.py, or capture/run.py before the capture wing was split, where it was
    `_write_shards`), imported under another name; the other modules it imports are this checkout's
    (the writer change touched that module alone)."""
    for module_path, name in (("capture/writers.py", "write_shards"), ("capture/run.py", "_write_shards")):
        shown = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{ref}:src/dflash_pipeline/{module_path}"],
                               capture_output=True, text=True)
        if shown.returncode == 0 and f"def {name}(" in shown.stdout:
            break
    else:
        raise click.ClickException(f"{ref}: neither capture/writers.py nor capture/run.py defines the stage's write path")
    path = scratch / "capture_baseline.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("capture_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return getattr(module, name)


def _shard_hashes(folder: Path) -> dict:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob("shard-*.arrow"))}


@click.command()
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--generated", type=click.Path(path_type=Path), default="data/generated/train.parquet", show_default=True)
@click.option("--fabricate", is_flag=True, help="Fabricated answers (bench/gpu.py's fabricate_generated) instead of --generated.")
@click.option("--sequences", "count", default=32, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--shard-mb", default=32, show_default=True)
@click.option("--threads", default=2, show_default=True, help="Writer threads of the threaded variant.")
@click.option("--baseline-ref", default="main", show_default=True)
@click.option("--scratch", type=click.Path(path_type=Path), default=None, help="Scratch folder (default: a temp dir).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(target_json, generated, fabricate, count, rounds, shard_mb, threads, baseline_ref, scratch, json_path):
    from dataclasses import replace

    import torch

    from dflash_pipeline.capture.forward import capture_batch
    from dflash_pipeline.capture.plan import SplitPlan, load_sequences, resolve_layer_ids
    from dflash_pipeline.capture.writers import default_writer_threads, write_planned_shards, write_shards
    from dflash_pipeline.foundation.config import CaptureConfig
    from dflash_pipeline.target.load import LayerTap, TargetInfo, load_target

    own_scratch = scratch is None
    scratch = Path(scratch or tempfile.mkdtemp(prefix="bench-capture-writers-"))
    scratch.mkdir(parents=True, exist_ok=True)
    if fabricate:
        from gpu import fabricate_generated  # read-only use of the GPU bench's fabricated answers

        fabricate_generated(scratch / "generated", prompts=count)
        generated = scratch / "generated" / "train.parquet"
    before_write_shards = baseline_write_shards(baseline_ref, scratch)
    info = TargetInfo.from_json(target_json)
    model, tokenizer = load_target(info)
    device = next(model.parameters()).device.type
    config = replace(CaptureConfig(), shard_mb=shard_mb)
    sequences, _ = load_sequences(generated, max_length=config.max_length, on_too_long="truncate")
    sequences = sequences[:count]
    layer_ids = resolve_layer_ids(config, info.num_layers)
    plan = SplitPlan.make(sequences, config=config, target=info, layer_ids=layer_ids,
                                  compute_dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    numbers = list(range(len(plan.shards)))
    tokens = sum(plan.shard_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    default_threads = default_writer_threads(device)
    print(f"{len(sequences)} sequences, {tokens:,} tokens, {sum(len(s) for s in plan.shards)} batches in {len(plan.shards)} shard(s) "
          f"of <= {shard_mb} MiB; {plan.token_bytes} B/token; device {device}, torch threads {torch.get_num_threads()}, "
          f"cores {len(os.sched_getaffinity(0))}; before = {baseline_ref}'s capture.py")

    tap = LayerTap(model, layer_ids)
    stage_variants = {
        "before (write_shards at the baseline ref)": lambda out: before_write_shards(
            numbers, plan, sequences, split="bench", out_dir=out, model=model, tap=tap, feature_dtype=config.feature_dtype,
            pad_id=pad_id, show_progress=False),
        f"after, default ({default_threads} writer threads)": lambda out: write_shards(
            numbers, plan, sequences, split="bench", out_dir=out, model=model, tap=tap, feature_dtype=config.feature_dtype,
            pad_id=pad_id, show_progress=False),
        f"after, {threads} writer threads": lambda out: write_shards(
            numbers, plan, sequences, split="bench", out_dir=out, model=model, tap=tap, feature_dtype=config.feature_dtype,
            pad_id=pad_id, show_progress=False, writer_threads=threads),
    }
    capture_batch(model, tap, [sequences[i] for i in plan.shards[-1][-1]], pad_id=pad_id, top_k=plan.top_k)  # warm-up
    stage_seconds = {name: [] for name in stage_variants}
    hashes = {}
    for round_index in range(rounds):
        order = list(stage_variants)
        order = order[round_index % len(order):] + order[: round_index % len(order)]  # each variant goes first in turn
        for name in order:
            run = stage_variants[name]
            out = scratch / "stage"
            out.mkdir()
            started = time.perf_counter()
            run(out)
            stage_seconds[name].append(time.perf_counter() - started)
            hashes[name] = _shard_hashes(out)
            shutil.rmtree(out)
        print(f"round {round_index + 1}: " + ", ".join(f"{name} {tokens / s[-1]:.0f} tok/s" for name, s in stage_seconds.items()))

    # 2. The writer alone, on batches captured once.
    by_batch = {}
    for shard in plan.shards:
        for indices in shard:
            batch = [sequences[i] for i in indices]
            by_batch[tuple(s.id for s in batch)] = capture_batch(model, tap, batch, pad_id=pad_id, top_k=plan.top_k,
                                                                        feature_dtype=config.feature_dtype).wait()
    tap.remove()
    writer_counts = sorted({0, 1, threads})
    writer_seconds = {n: [] for n in writer_counts}
    written = 0
    for _ in range(rounds):
        for n in writer_counts:
            out = scratch / "writer"
            out.mkdir()
            started = time.perf_counter()
            write_planned_shards(numbers, plan, sequences, out_dir=out, feature_dtype=config.feature_dtype, writer_threads=n,
                                         produce=lambda batch: by_batch[tuple(s.id for s in batch)])
            writer_seconds[n].append(time.perf_counter() - started)
            written = sum(p.stat().st_size for p in out.glob("shard-*.arrow"))
            shutil.rmtree(out)

    def rate(seconds):  # tokens/s over all rounds
        return tokens * len(seconds) / sum(seconds)

    names = list(stage_variants)
    results = {
        "machine": f"{len(os.sched_getaffinity(0))}-core CPU, torch threads {torch.get_num_threads()}",
        "target": info.fingerprint[:12], "sequences": len(sequences), "tokens": tokens, "shards": len(plan.shards),
        "shard_mb": shard_mb, "bytes_per_token": plan.token_bytes, "rounds": rounds, "baseline_ref": baseline_ref,
        "stage_tokens_per_s": {name: round(rate(s), 1) for name, s in stage_seconds.items()},
        "stage_after_default_vs_before": round(rate(stage_seconds[names[1]]) / rate(stage_seconds[names[0]]), 3),
        f"stage_after_{threads}_threads_vs_before": round(rate(stage_seconds[names[2]]) / rate(stage_seconds[names[0]]), 3),
        "same_shard_bytes": hashes[names[0]] == hashes[names[1]] == hashes[names[2]],
        "writer_gb_per_s": {f"{n} threads": round(written * len(s) / sum(s) / 1e9, 4) for n, s in writer_seconds.items()},
        f"writer_{threads}_threads_vs_inline": round(sum(writer_seconds[0]) / sum(writer_seconds[threads]), 3),
        f"writer_{threads}_threads_vs_1_thread": round(sum(writer_seconds[1]) / sum(writer_seconds[threads]), 3),
    }
    print(f"1. stage write path, after (default) / before = {results['stage_after_default_vs_before']}, "
          f"after ({threads} threads) / before = {results[f'stage_after_{threads}_threads_vs_before']}; "
          f"same shard bytes: {results['same_shard_bytes']}")
    print(f"2. writer alone: {results['writer_gb_per_s']} GB/s")
    print(json.dumps(results, indent=1))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    if own_scratch:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
