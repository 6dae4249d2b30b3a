"""What a rerun of capture keeps, and how the output appears: the shards already there are
checked against their writer's sha256 record, the manifest is written once a split is complete,
and the `<out>.partial` work folder (run.py's docstring says why) is adopted from a finished output
and renamed into place at the end.

A shard already there is kept only when its sha256 equals a record made when it was written:
its `.sha256` file (a run not finished yet) or the previous manifest (a finished one; both are
only ever left by a run of this same capture record, since other settings empty the folder).
Anything else, a flipped bit that Arrow still reads included, is rebuilt, and the run says so.
"""

import os
import shutil
from collections import Counter
from pathlib import Path

from dflash_pipeline.capture.plan import Sequence, SplitPlan, shard_name
from dflash_pipeline.data.shards import SHA256_SUFFIX, SHARD_GLOB, Manifest, ShardInfo
from dflash_pipeline.foundation.files import recorded_sha256, sha256_record_path
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import sha256_file
from dflash_pipeline.target.load import TargetInfo


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


def drop_unverified_shards(out_dir: Path, split: str, count: int) -> None:
    """Remove every existing shard of the plan that does not match its record; print one line."""
    previous = _previous_manifest_entries(out_dir, split)
    dropped = []
    for number in range(count):
        path = out_dir / shard_name(number)
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


def write_manifest(plan: SplitPlan, sequences: list[Sequence], stats: Counter, *, split: str, out_dir: Path, target: TargetInfo,
                   layer_ids: list[int], feature_dtype: str) -> Manifest:
    shards = []
    for number in range(len(plan.shards)):
        path = out_dir / shard_name(number)
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


def adopt_finished_output(out_dir: Path, work_dir: Path) -> None:
    """Rank 0, before any rank writes: with no interrupted run to resume, a finished output (a run
    outside DVC; DVC deletes its own before the stage) becomes the starting point, moved, not copied.
    Files linked to the DVC cache stay safe: capture replaces files by rename, never edits one."""
    if out_dir.is_dir() and not work_dir.exists():
        os.replace(out_dir, work_dir)


def publish_output(work_dir: Path, out_dir: Path) -> None:
    """Rank 0, after every rank finished: the whole output appears under its name in one rename."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(work_dir, out_dir)
