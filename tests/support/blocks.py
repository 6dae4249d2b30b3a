"""Packed training blocks and their one-block-at-a-time reference."""

import torch

from dflash_pipeline.data.masks import dflash_mask
from dflash_pipeline.drafters.config import DrafterConfig

VOCAB = 97

def reference_block(drafter, head, features, ids, anchor):
    """One block, the obvious way: its context is exactly features[:anchor], everything visible."""
    config = drafter.config
    block = block_ids(int(ids[anchor]), config)
    with torch.no_grad():
        return drafter.forward_blocks(
            features[:anchor], torch.arange(anchor), head.embed(block),
            torch.arange(anchor, anchor + config.block_size), mask=None,
        )

def packed_blocks(drafter, head, sequences, anchors_per_sequence):
    """All blocks of all sequences in one forward with the DFlash mask."""
    config = drafter.config
    features = torch.cat([f for f, _ in sequences])
    context_positions = torch.cat([torch.arange(len(f)) for f, _ in sequences])
    context_sequence = torch.cat([torch.full((len(f),), s) for s, (f, _) in enumerate(sequences)])
    embeddings, positions, sequence_of, anchor_of, index_of = [], [], [], [], []
    block_number = 0
    for s, ((_, ids), anchors) in enumerate(zip(sequences, anchors_per_sequence)):
        for anchor in anchors:
            embeddings.append(head.embed(block_ids(int(ids[anchor]), config)))
            positions.append(torch.arange(anchor, anchor + config.block_size))
            sequence_of.append(torch.full((config.block_size,), s))
            anchor_of.append(torch.full((config.block_size,), anchor))
            index_of.append(torch.full((config.block_size,), block_number))
            block_number += 1
    mask = dflash_mask(context_sequence, context_positions, torch.cat(sequence_of), torch.cat(anchor_of), torch.cat(index_of))
    with torch.no_grad():
        out = drafter.forward_blocks(features, context_positions, torch.cat(embeddings), torch.cat(positions), mask)
    return out.view(block_number, config.block_size, -1)


def block_ids(anchor_token: int, config: DrafterConfig) -> torch.Tensor:
    return torch.tensor([anchor_token] + [config.mask_token_id] * (config.block_size - 1))
