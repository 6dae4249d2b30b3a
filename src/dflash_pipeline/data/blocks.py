"""Blocks: where a drafter is asked to draft, and the packed batch one DFlash forward drafts them in.

A block anchored at position a of a sequence holds the committed token at a (slot 0) and B-1 mask
tokens; the drafter sees the target's features of positions < a and drafts slots 1..B-1, which
should reproduce the sequence's tokens a+1..a+B-1. An anchor must be answer text followed by
answer text (`valid_anchors`). Training, train's periodic τ and evaluate all build their
forwards with `build_batch`, so the three see blocks the same way, sliding window included.

Anchors are drawn per sequence from a seed, so a sequence gets the same anchors whichever batch,
rank or scorer it lands in: `training_anchor_seed` for the training steps, `scoring_anchor_seed`
for every held-out score (train's periodic τ and evaluate).
"""

from dataclasses import dataclass

import torch

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.drafters.core import dflash_mask


def training_anchor_seed(seed: int, step: int, position: int) -> int:
    """The anchor seed of the `position`-th sequence of training step `step` (fresh every step)."""
    return seed * 1_000_003 + step * 10_007 + position


def scoring_anchor_seed(seed: int, sequence: int) -> int:
    """The anchor seed of val sequence `sequence` when scoring: the same for every drafter and
    every scorer, so drafters are compared on the same blocks."""
    return seed * 1_000_003 + 7919 + sequence


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a with loss_mask[a] = loss_mask[a+1] = 1: the anchor is committed answer text and
    there is at least one answer token after it to draft."""
    mask = loss_mask.bool()
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def draw_anchors(loss_mask: torch.Tensor, count: int, seed: int) -> list[int]:
    """Up to `count` valid anchors drawn without replacement from `seed`, in ascending order."""
    candidates = valid_anchors(loss_mask)
    if candidates.numel() == 0:
        return []
    take = min(count, candidates.numel())
    generator = torch.Generator().manual_seed(seed)
    return candidates[torch.randperm(candidates.numel(), generator=generator)[:take]].sort().values.tolist()


@dataclass
class Batch:
    """The blocks of one forward and what they should draft. What only training needs (slot
    weights, the target's distributions) is training's to add (`train.loss.training_targets`)."""

    block_size: int  # B: slot 0 the anchor, slots 1..B-1 drafted; the one copy the batch's users read
    features: list[torch.Tensor]  # per sequence [S_i, N*H]; together the packed context [C, N*H]
    context_positions: torch.Tensor  # [C]
    block_ids: torch.Tensor  # [Q] anchor token, then mask tokens, per block
    block_positions: torch.Tensor  # [Q]
    mask: torch.Tensor  # [Q, C + Q] which keys each block query sees
    labels: torch.Tensor  # [blocks, B-1] token each drafted slot should produce
    exists: torch.Tensor  # [blocks, B-1] bool: the slot holds an answer token to compare with
    block_sequence: torch.Tensor  # [blocks] index of the block's sequence within the batch
    context_tokens: int

    @property
    def anchors(self) -> torch.Tensor:
        """[blocks] anchor position of each block."""
        return self.block_positions.view(-1, self.block_size)[:, 0]

    @property
    def anchor_ids(self) -> torch.Tensor:
        """[blocks] anchor token of each block (its slot 0)."""
        return self.block_ids.view(-1, self.block_size)[:, 0]

    def drafted(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafted slots' rows [blocks, B-1, ...] of a forward's output [Q, ...] (slot 0 dropped)."""
        return hidden.view(-1, self.block_size, *hidden.shape[1:])[:, 1:]

    def to(self, device: str) -> "Batch":
        """The tensors the forward reads moved to `device`; labels and weights stay where they are."""
        if device == "cpu":
            return self
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k in ("context_positions", "block_ids",
                                                                                                "block_positions", "mask") else v)
                 for k, v in self.__dict__.items()}
        moved["features"] = [piece.to(device, non_blocking=True) for piece in self.features]
        return Batch(**moved)


def build_batch(samples, *, anchors_per_sequence: int, block_size: int, mask_token_id: int, anchor_seeds: list[int],
                sliding_window: int | None = None) -> Batch:
    """Pack sequences and their anchors into one DFlash forward's inputs.

    Each sequence draws its anchors from its own seed (`anchor_seeds`). `sliding_window` is the
    drafter's: context keys further back than that from the anchor are masked, as at decoding.
    """
    features, context_positions, context_sequence = [], [], []
    block_ids, block_positions, block_sequence, block_anchor, block_index = [], [], [], [], []
    labels, exists, sequence_of_block = [], [], []
    offsets = torch.arange(block_size)
    blocks = 0
    for number, sample in enumerate(samples):
        length = sample.input_ids.shape[0]
        ids = sample.input_ids.long()
        mask = sample.loss_mask.bool()
        features.append(sample.features)
        context_positions.append(torch.arange(length))
        context_sequence.append(torch.full((length,), number))
        for anchor in draw_anchors(sample.loss_mask, anchors_per_sequence, anchor_seeds[number]):
            slots = anchor + offsets
            block = torch.full((block_size,), mask_token_id, dtype=torch.long)
            block[0] = ids[anchor]
            block_ids.append(block)
            block_positions.append(slots)
            block_sequence.append(torch.full((block_size,), number))
            block_anchor.append(torch.full((block_size,), anchor))
            block_index.append(torch.full((block_size,), blocks))
            target_slots = slots[1:].clamp(max=length - 1)
            labels.append(ids[target_slots])
            exists.append(mask[target_slots] & (slots[1:] < length))
            sequence_of_block.append(number)
            blocks += 1
    if blocks == 0:
        raise PipelineError("train: no sequence in this batch has two answer tokens in a row to anchor a block")
    context_sequence_t, context_positions_t = torch.cat(context_sequence), torch.cat(context_positions)
    mask = dflash_mask(context_sequence_t, context_positions_t, torch.cat(block_sequence), torch.cat(block_anchor), torch.cat(block_index),
                       sliding_window=sliding_window)
    return Batch(
        block_size=block_size,
        features=features,
        context_positions=context_positions_t,
        block_ids=torch.cat(block_ids),
        block_positions=torch.cat(block_positions),
        mask=mask,
        labels=torch.stack(labels),
        exists=torch.stack(exists),
        block_sequence=torch.tensor(sequence_of_block),
        context_tokens=int(context_positions_t.numel()),
    )
