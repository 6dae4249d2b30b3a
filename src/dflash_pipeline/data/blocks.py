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

import dataclasses
from dataclasses import dataclass

import torch

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.data.masks import dflash_block_mask, dflash_mask


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


def draw_step_anchors(answer: torch.Tensor, lengths: torch.Tensor, count: int, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchors `draw_anchors` gives each sequence of a packed batch, for all of them at once.

    answer [C] bool: the sequences' loss masks, packed; lengths [n]; seeds [n] one per sequence.
    Returns (anchors [blocks]: each block's position within its sequence, ascending per sequence;
    block_sequence [blocks]: its sequence), exactly equal to `draw_anchors` sequence by sequence.
    The candidates, their counts, the offsets and the ordering are whole-batch tensor ops; what
    stays per sequence is its seeded permutation, since that is what makes a sequence's anchors
    the same whichever batch, rank or scorer it lands in (`training_anchor_seed`): one reseeded
    generator and one `randperm` each, about a quarter of the loop it replaces.
    """
    total = answer.shape[0]
    starts = torch.cumsum(lengths, 0) - lengths
    sequence = torch.arange(lengths.shape[0]).repeat_interleave(lengths, output_size=total)  # [C]
    # A candidate is answer text followed by answer text of the same sequence (`valid_anchors`).
    last = torch.zeros(total, dtype=torch.bool)
    last[(starts + lengths - 1)[lengths > 0]] = True
    following = torch.cat([answer[1:], answer.new_zeros(1)])
    candidates = torch.nonzero(answer & following & ~last).flatten()  # [candidates] packed positions, ascending
    available = torch.bincount(sequence[candidates], minlength=lengths.shape[0])
    generator = torch.Generator()
    picks, takes = [], []
    for have, seed in zip(available.tolist(), seeds):
        take = min(count, have)
        takes.append(take)
        if take:
            picks.append(torch.randperm(have, generator=generator.manual_seed(seed))[:take])
    if not picks:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    takes = torch.tensor(takes)
    first = torch.cumsum(available, 0) - available  # each sequence's first candidate
    chosen = torch.cat(picks) + first.repeat_interleave(takes, output_size=int(takes.sum()))
    # Candidates are packed in sequence order, so one sort orders every sequence's anchors.
    positions = candidates[chosen.sort().values]
    block_sequence = sequence[positions]
    return positions - starts[block_sequence], block_sequence


@dataclass
class Batch:
    """The blocks of one forward and what they should draft. What only training needs (slot
    weights, the target's distributions) is training's to add (`train.loss.training_targets`).

    The attention mask is not stored: it follows from ~10 bytes of metadata per key and per block
    (which sequence, which position, which anchor), and is built where it is used, on the batch's
    device: dense for SDPA (`dense_mask`), or as a flex-attention BlockMask (`block_mask`) that
    never materialises the [Q, C + Q] matrix. A dense mask is ~0.6 GB at 16K context tokens and
    block 16; building it on the host and copying it was most of a GPU train step.
    """

    block_size: int  # B: slot 0 the anchor, slots 1..B-1 drafted; the one copy the batch's users read
    # [C, N*H] every sequence's target features, packed; or None while they are rows of a split
    # held on the device (`feature_rows`, resolved by `with_features`)
    features: torch.Tensor | None
    context_positions: torch.Tensor  # [C]
    context_sequence: torch.Tensor  # [C] index of the key's sequence within the batch (-1: padding)
    block_ids: torch.Tensor  # [Q] anchor token, then mask tokens, per block
    block_positions: torch.Tensor  # [Q]
    labels: torch.Tensor  # [blocks, B-1] token each drafted slot should produce
    exists: torch.Tensor  # [blocks, B-1] bool: the slot holds an answer token to compare with
    block_sequence: torch.Tensor  # [blocks] index of the block's sequence within the batch (-1: padding)
    context_tokens: int  # real context tokens (padding excluded)
    sliding_window: int | None = None  # the drafter's: context keys further back than this from the anchor are masked
    feature_rows: torch.Tensor | None = None  # [C] each key's row in a resident feature table, when `features` is None

    def with_features(self, table: torch.Tensor) -> "Batch":
        """The batch with its features gathered from `table` (a split's features on the device,
        rows as `feature_rows`): one gather instead of a copy from the host."""
        if self.features is not None:
            return self
        return dataclasses.replace(self, features=table[self.feature_rows], feature_rows=None)

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

    def dense_mask(self) -> torch.Tensor:
        """[Q, C + Q] bool, True = visible (`dflash_mask`), on the batch's device."""
        size = self.block_size
        blocks = torch.arange(self.block_sequence.shape[0], device=self.block_sequence.device)
        return dflash_mask(self.context_sequence, self.context_positions, self.block_sequence.repeat_interleave(size),
                           self.anchors.repeat_interleave(size), blocks.repeat_interleave(size), sliding_window=self.sliding_window)

    @property
    def mask(self) -> torch.Tensor:
        return self.dense_mask()

    def block_mask(self):
        """The same visibility as a flex-attention BlockMask, built on the batch's device from the
        metadata alone (`dflash_block_mask`)."""
        return dflash_block_mask(self.context_sequence, self.context_positions, self.block_sequence, self.anchors,
                                 block_size=self.block_size, sliding_window=self.sliding_window)

    def attention_mask(self, attention: str):
        """What `forward_blocks` takes for this attention backend: "sdpa" a dense mask, "flex" a BlockMask."""
        return self.block_mask() if attention == "flex" else self.dense_mask()

    def padded(self, *, context_tokens: int, blocks: int, mask_token_id: int) -> "Batch":
        """The batch grown to exactly `context_tokens` keys and `blocks` blocks, for static shapes
        (a compiled or CUDA-graphed step sees one shape whatever the step packs). Padding keys
        belong to no sequence (-1) and are never visible; a padding block sees only itself (a
        row with no visible key would be NaN), drafts mask tokens and has no slot that exists,
        so it carries zero loss weight."""
        keys = self.context_positions.shape[0]
        extra_context, extra_blocks = context_tokens - keys, blocks - self.block_sequence.shape[0]
        if extra_context < 0 or extra_blocks < 0:
            raise PipelineError(f"train: a step holds {keys} context tokens and {self.block_sequence.shape[0]} blocks, "
                                f"more than the static shape {context_tokens} x {blocks}")
        size = self.block_size

        def grow(tensor, count, value):
            return torch.cat([tensor, tensor.new_full((count, *tensor.shape[1:]), value)])

        return Batch(
            block_size=size,
            features=None if self.features is None else grow(self.features, extra_context, 0),
            feature_rows=None if self.feature_rows is None else grow(self.feature_rows, extra_context, 0),
            context_positions=grow(self.context_positions, extra_context, 0),
            context_sequence=grow(self.context_sequence, extra_context, -1),
            block_ids=grow(self.block_ids, extra_blocks * size, mask_token_id),
            block_positions=torch.cat([self.block_positions, torch.arange(size).repeat(extra_blocks).to(self.block_positions)]),
            labels=grow(self.labels, extra_blocks, 0),
            exists=grow(self.exists, extra_blocks, False),
            block_sequence=grow(self.block_sequence, extra_blocks, -1),
            context_tokens=self.context_tokens,
            sliding_window=self.sliding_window,
        )

    def to(self, device: str) -> "Batch":
        """Every tensor moved to `device` (non-blocking: asynchronous from pinned memory)."""
        if device == "cpu":
            return self
        moved = {key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
                 for key, value in self.__dict__.items()}
        return Batch(**moved)


def build_batch(samples, *, anchors_per_sequence: int, block_size: int, mask_token_id: int, anchor_seeds: list[int],
                sliding_window: int | None = None, pin_memory: bool = False, feature_starts: list[int] | None = None) -> Batch:
    """Pack sequences and their anchors into one DFlash forward's inputs.

    Each sequence draws its anchors from its own seed (`anchor_seeds`; `draw_step_anchors` draws
    them for the whole batch at once, the same anchors as `draw_anchors` sequence by sequence). `sliding_window` is the
    drafter's: context keys further back than that from the anchor are masked, as at decoding.
    Everything past each sequence's seeded permutation is a handful of whole-batch tensor ops.
    `pin_memory` packs the features into page-locked memory, so the copy to a GPU is asynchronous.
    `feature_starts` (each sample's first row in a feature table held on the device) packs no
    features at all: the batch carries their rows (`feature_rows`, `Batch.with_features`).
    """
    lengths = torch.tensor([sample.input_ids.shape[0] for sample in samples])
    starts = torch.cumsum(lengths, 0) - lengths
    answer = torch.cat([sample.loss_mask.bool() for sample in samples])
    anchors, block_sequence = draw_step_anchors(answer, lengths, anchors_per_sequence, anchor_seeds)
    if anchors.numel() == 0:
        raise PipelineError("train: no sequence in this batch has two answer tokens in a row to anchor a block")
    sequences = torch.arange(len(samples))
    context_sequence = sequences.repeat_interleave(lengths)
    context_positions = torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)
    ids = torch.cat([sample.input_ids.long() for sample in samples])
    features = feature_rows = None
    if feature_starts is None:
        pieces = [sample.features for sample in samples]
        features = torch.empty((ids.shape[0], pieces[0].shape[1]), dtype=pieces[0].dtype, pin_memory=pin_memory)
        torch.cat(pieces, out=features)
    else:
        feature_rows = torch.tensor(feature_starts).repeat_interleave(lengths) + context_positions

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
