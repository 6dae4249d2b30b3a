"""What capture will write, decided before any forward: the sequences of a split (prompt + answer
ids, the loss mask on the answer), the target layers to tap, and the plan that cuts the sequences
into shards of about `shard_mb` and each shard into batches of at most `batch_tokens` padded tokens
(`SplitPlan`), with the record (`capture.json`) of everything a shard's bytes depend on.

The plan alone decides what goes where: a rerun rewrites a missing shard byte for byte the same,
and torchrun ranks take their shards of the one plan.
"""

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.data.prompts import read_generated
from dflash_pipeline.data.shards import bytes_per_token
from dflash_pipeline.foundation.config import CaptureConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import TargetInfo, build_target_layer_ids


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


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.arrow"


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
