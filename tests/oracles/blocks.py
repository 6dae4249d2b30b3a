"""The per-anchor `build_batch` as it was before the batch was vectorised (commit 0121fa1): the
reference the vectorised one must equal tensor for tensor (tests/train/test_gpu_contract.py).
It returns the old layout: per-sequence feature pieces and the dense mask."""

import torch

from dflash_pipeline.data.blocks import draw_anchors
from dflash_pipeline.data.masks import dflash_mask


def per_anchor_build_batch(samples, *, anchors_per_sequence: int, block_size: int, mask_token_id: int, anchor_seeds: list[int],
                           sliding_window: int | None = None) -> dict:
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
    context_sequence_t, context_positions_t = torch.cat(context_sequence), torch.cat(context_positions)
    mask = dflash_mask(context_sequence_t, context_positions_t, torch.cat(block_sequence), torch.cat(block_anchor), torch.cat(block_index),
                       sliding_window=sliding_window)
    return dict(features=features, context_positions=context_positions_t, block_ids=torch.cat(block_ids),
                block_positions=torch.cat(block_positions), mask=mask, labels=torch.stack(labels), exists=torch.stack(exists),
                block_sequence=torch.tensor(sequence_of_block), context_tokens=int(context_positions_t.numel()))
