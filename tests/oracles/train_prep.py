"""A step's batch and targets as `prepare_step` built them before issue #37 item 2: anchors drawn
sequence by sequence in a Python loop (`draw_anchors`), the target's top-k of the whole step
concatenated and converted before the slots' rows were gathered. The reference the vectorised
`build_batch` / `training_targets` must equal tensor for tensor (tests/train/test_prepare.py)."""

import torch

from dflash_pipeline.data.blocks import Batch, draw_anchors
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.train.loss import TrainingTargets, decay_weights


def per_sequence_build_batch(samples, *, anchors_per_sequence: int, block_size: int, mask_token_id: int, anchor_seeds: list[int],
                sliding_window: int | None = None, pin_memory: bool = False, feature_starts: list[int] | None = None) -> Batch:
    """Pack sequences and their anchors into one DFlash forward's inputs.

    Each sequence draws its anchors from its own seed (`anchor_seeds`). `sliding_window` is the
    drafter's: context keys further back than that from the anchor are masked, as at decoding.
    Everything past the per-sequence anchor draw is a handful of whole-batch tensor ops.
    `pin_memory` packs the features into page-locked memory, so the copy to a GPU is asynchronous.
    `feature_starts` (each sample's first row in a feature table held on the device) packs no
    features at all: the batch carries their rows (`feature_rows`, `Batch.with_features`).
    """
    anchor_lists = [draw_anchors(sample.loss_mask, anchors_per_sequence, seed) for sample, seed in zip(samples, anchor_seeds)]
    counts = torch.tensor([len(anchors) for anchors in anchor_lists])
    if int(counts.sum()) == 0:
        raise PipelineError("train: no sequence in this batch has two answer tokens in a row to anchor a block")
    lengths = torch.tensor([sample.input_ids.shape[0] for sample in samples])
    starts = torch.cumsum(lengths, 0) - lengths
    sequences = torch.arange(len(samples))
    context_sequence = sequences.repeat_interleave(lengths)
    context_positions = torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)
    ids = torch.cat([sample.input_ids.long() for sample in samples])
    answer = torch.cat([sample.loss_mask.bool() for sample in samples])
    features = feature_rows = None
    if feature_starts is None:
        pieces = [sample.features for sample in samples]
        features = torch.empty((ids.shape[0], pieces[0].shape[1]), dtype=pieces[0].dtype, pin_memory=pin_memory)
        torch.cat(pieces, out=features)
    else:
        feature_rows = torch.tensor(feature_starts).repeat_interleave(lengths) + context_positions

    block_sequence = sequences.repeat_interleave(counts)
    anchors = torch.tensor([anchor for anchors in anchor_lists for anchor in anchors], dtype=torch.long)
    slots = anchors[:, None] + torch.arange(block_size)  # [blocks, B]
    length, start = lengths[block_sequence][:, None], starts[block_sequence][:, None]
    drafted = slots[:, 1:]
    target_rows = start + drafted.clamp(max=length - 1)
    block_ids = torch.full(slots.shape, mask_token_id, dtype=torch.long)
    block_ids[:, 0] = ids[start[:, 0] + anchors]
    return Batch(
        block_size=block_size,
        features=features,
        context_positions=context_positions,
        context_sequence=context_sequence,
        block_ids=block_ids.reshape(-1),
        block_positions=slots.reshape(-1),
        labels=ids[target_rows],
        exists=answer[target_rows] & (drafted < length),
        block_sequence=block_sequence,
        context_tokens=int(lengths.sum()),
        sliding_window=sliding_window,
        feature_rows=feature_rows,
    )


def gathered_training_targets(batch: Batch, samples, gamma: float) -> TrainingTargets:
    """Slot weights exp(-(k-1)/gamma) where the slot exists, and, when every sample carries the
    target's top-K (capture.target_top_k > 0), each slot's target distribution: slot k's token
    follows position a + k - 1, so the distribution captured there."""
    weights = decay_weights(batch.block_size, gamma) * batch.exists.float()
    if not all(getattr(s, "target_topk_ids", None) is not None and s.target_topk_ids.shape[-1] > 0 for s in samples):
        return TrainingTargets(weights)
    lengths = torch.tensor([sample.input_ids.shape[0] for sample in samples])
    starts = (torch.cumsum(lengths, 0) - lengths)[batch.block_sequence][:, None]
    slots = batch.anchors[:, None].cpu() + torch.arange(1, batch.block_size)
    rows = starts + slots.clamp(max=lengths[batch.block_sequence][:, None] - 1) - 1  # the position before each slot
    soft_ids = torch.cat([sample.target_topk_ids for sample in samples]).long()[rows]
    soft_logprobs = torch.cat([sample.target_topk_logprobs for sample in samples]).float()[rows]
    return TrainingTargets(weights, soft_ids, soft_logprobs)
