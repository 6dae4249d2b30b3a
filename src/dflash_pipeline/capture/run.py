"""Stage `capture`: one target forward per sequence; selected layers' outputs into Arrow shards.

Input: `data/generated/{train,val}.parquet` (exact token ids from `generate`) and the target.
Output per split: `shard-NNNNN.arrow` files and `manifest.json` (format in `shards.py`), plus
`capture.json`, the settings and plan the shards were made with. `run_capture` returns a summary
whose `this_run` part (seconds, shards written now) is the only part that differs between two
runs on the same inputs; the stage script writes it as a metrics file outside the data folder,
so a rerun that changes no shard leaves the output, and every stage after it, unchanged.

Layer id i means the OUTPUT of decoder layer i (`target.load.LayerTap`): forward hooks keep only the
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
while a plain output is deleted, which only unlinks (bench/studies/dvc_costs.py). A run outside DVC
that finds a finished `<out>` and no `.partial` starts from it, so its shards are reused as before.
When DVC serves `<out>` from its run cache instead of running the stage (a rerun after a kill, with
settings it has seen), a killed run's `.partial` stays behind: `make repro` removes it
(`dflash-pipeline verify --repair`, README "Recovery"). The pipeline cannot remove it on its own:
a run-cache restore runs none of our code; a folder inside `<out>` would be deleted by DVC before
every rerun of the stage, with the finished shards it is there to keep; and no stage is sure to
run after a restore (train is restored too when its inputs are), short of an `always_changed`
stage, which would make every `dvc status` report a change. Left alone it is still of use: a
later run with the settings that made it resumes from it.

The parts: `plan` (what goes where), `forward` (one batch through the target), `writers` (the
shards, written on threads), `resume` (what a rerun keeps; the output's one rename). This module
runs them for both splits, in one process or as one rank of torchrun.
"""

import shutil
import time
from collections import Counter
from pathlib import Path

from dflash_pipeline.capture.forward import warmup_tokens_per_s
from dflash_pipeline.capture.plan import (
    Sequence,
    SplitPlan,
    load_sequences,
    resolve_layer_ids,
    shard_name,
)
from dflash_pipeline.capture.resume import (
    adopt_finished_output,
    drop_unverified_shards,
    publish_output,
    write_manifest,
)
from dflash_pipeline.capture.writers import write_shards
from dflash_pipeline.data.shards import SHARD_GLOB, Manifest
from dflash_pipeline.foundation.config import CaptureConfig, as_dict
from dflash_pipeline.foundation.distributed import barrier as wait_for_every_rank
from dflash_pipeline.foundation.distributed import init_distributed, leave_process_group
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import format_bytes, reuse_or_reset, staging_dir
from dflash_pipeline.target.load import LayerTap, TargetInfo
from dflash_pipeline.target.placement import TargetPlacement

SPLITS = ("train", "val")


def _prepare_split(plan: SplitPlan, sequences: list[Sequence], *, split: str, out_dir: Path, model, tap, config: CaptureConfig,
                   layer_ids: list[int], hidden_size: int, pad_id: int, world: int) -> list[int]:
    """Rank 0, before any rank writes: keep only verified shards of these settings, print the
    estimate, check the disk. Returns the shard numbers still to write."""
    dropped = reuse_or_reset(out_dir, "capture.json", plan.record, SHARD_GLOB)
    if dropped:
        print(f"capture {split}: inputs or settings changed; removed {dropped} old shard(s)")
    drop_unverified_shards(out_dir, split, len(plan.shards))
    missing = [n for n in range(len(plan.shards)) if not (out_dir / shard_name(n)).is_file()]
    missing_tokens = sum(plan.shard_tokens[n] for n in missing)
    total_tokens = sum(plan.shard_tokens)
    line = (
        f"capture {split}: {len(sequences)} sequences, {total_tokens:,} tokens in {len(plan.shards)} shard(s), "
        f"{len(plan.shards) - len(missing)} already done; layers {layer_ids} x {hidden_size} in {config.feature_dtype} "
        f"= {plan.token_bytes} B/token -> {format_bytes(total_tokens * plan.token_bytes)}"
    )
    if missing:
        rate = warmup_tokens_per_s(model, tap, sequences, pad_id) * world
        line += f"; about {missing_tokens / rate / 60:.1f} min at {rate:.0f} tokens/s (warm-up batch)"
    print(line)
    needed, free = missing_tokens * plan.token_bytes, shutil.disk_usage(out_dir).free
    if needed * 1.02 > free:
        raise PipelineError(f"{out_dir}: capture needs about {format_bytes(needed)} for shards, only {format_bytes(free)} free on that disk")
    return missing


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
    todo = [n for n in range(rank, len(plan.shards), world) if not (out_dir / shard_name(n)).is_file()]
    write_shards(todo, plan, sequences, split=split, out_dir=out_dir, model=model, tap=tap, feature_dtype=config.feature_dtype,
                 pad_id=pad_id, show_progress=rank == 0, writer_threads=writer_threads)
    if barrier is not None:
        barrier()
    if rank != 0:
        return None, {}
    absent = [n for n in range(len(plan.shards)) if not (out_dir / shard_name(n)).is_file()]
    if absent:
        # Every rank has finished its shards: one rank 0 cannot see was written to another machine's disk.
        raise PipelineError(f"{out_dir / shard_name(absent[0])}: written by rank {absent[0] % world} of {world} but not "
                            f"visible to rank 0 ({len(absent)} shard(s) absent); on several machines --out must be "
                            "a folder all nodes share")
    manifest = write_manifest(plan, sequences, stats, split=split, out_dir=out_dir, target=target, layer_ids=layer_ids,
                              feature_dtype=config.feature_dtype)
    return manifest, {"shards_written": len(missing), "shards_kept": len(plan.shards) - len(missing),
                      "tokens_written": sum(plan.shard_tokens[n] for n in missing)}


def check_split_sizes(sequences: dict[str, list[Sequence]], stats: dict[str, Counter], generated_dir: Path) -> None:
    """Refuse, before any forward, a split left without a sequence: train has nothing to learn from,
    and the val split is what train and evaluate score (a one-prompt file gives 0 val prompts)."""
    for split in SPLITS:
        if not sequences[split]:
            counts = ", ".join(f"{key} {value}" for key, value in sorted(stats[split].items()) if key != "rows")
            raise PipelineError(f"capture: {generated_dir / (split + '.parquet')}: the {split} split has no sequence to capture "
                                f"({stats[split]['rows']} row(s){'; ' + counts if counts else ''}); rerun generate with more prompts")


def run_capture(config: CaptureConfig, *, target: TargetInfo, generated_dir: Path, out_dir: Path, device: str,
                source: str = "params.yaml", writer_threads: int | None = None, placement: TargetPlacement | None = None) -> dict:
    """Capture both splits, single-process or as one rank of torchrun; return a summary (rank 0):
    what the shards hold under "splits", and this run's work and timings under "this_run".
    The work happens in `staging_dir(out_dir)`, renamed to `out_dir` at the end. `source`: the
    params file `config` came from, named in configuration errors. `writer_threads`: shards
    written at once (None: `default_writer_threads`); the shards' bytes do not depend on it.
    `placement`: the target split over devices (`target.placement`; None: whole on `device`)."""
    from dflash_pipeline.target.load import load_target

    config.validate_context(target.max_position_embeddings, source)
    device, world, rank = init_distributed(device, devices_per_replica=placement.devices_per_replica if placement else 1)
    barrier = (lambda: wait_for_every_rank(world)) if world > 1 else None
    try:
        layer_ids = resolve_layer_ids(config, target.num_layers, source=source)
        loaded = {split: load_sequences(generated_dir / f"{split}.parquet", max_length=config.max_length, on_too_long=config.on_too_long)
                  for split in SPLITS}
        check_split_sizes({split: pair[0] for split, pair in loaded.items()}, {split: pair[1] for split, pair in loaded.items()},
                          Path(generated_dir))
        model, tokenizer = load_target(target, device=device, placement=placement)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        tap = LayerTap(model, layer_ids)
        out_dir = Path(out_dir)
        work_dir = staging_dir(out_dir)
        if rank == 0:
            adopt_finished_output(out_dir, work_dir)
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
            publish_output(work_dir, out_dir)
        summary["config"] = as_dict(config)
        return summary
    finally:
        leave_process_group(world)
