"""The DFlash attention masks of a batch of blocks: which context keys and block keys each block
query sees, as a dense boolean mask (`dflash_mask`) or as flex-attention's BlockMask built from
per-key and per-block metadata only (`dflash_block_mask`). They belong to the data of a batch
(`blocks.build_batch` makes them); the drafter's attention consumes them."""

import torch


def dflash_mask(
    context_sequence: torch.Tensor,
    context_positions: torch.Tensor,
    block_sequence: torch.Tensor,
    block_anchor: torch.Tensor,
    block_index: torch.Tensor,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The DFlash training mask [Q, C + Q] (True = visible), built with tensor ops.

    A block query (its block drafted from anchor a of sequence s) sees the context keys of
    sequence s at positions j < a (the anchor's own features do not exist yet at inference),
    and every key of its own block (bidirectional); nothing of other blocks or sequences.
    """
    same_sequence = block_sequence[:, None] == context_sequence[None, :]
    before_anchor = context_positions[None, :] < block_anchor[:, None]
    visible_context = same_sequence & before_anchor
    if sliding_window is not None:
        visible_context &= context_positions[None, :] >= block_anchor[:, None] - sliding_window
    same_block = block_index[:, None] == block_index[None, :]
    return torch.cat([visible_context, same_block], dim=1)


FLEX_TILE = 128  # flex-attention's default sparse block: the mask is decided per 128 x 128 tile


def _tile_range(values: torch.Tensor, tile: int, low_fill: int, high_fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of `values` [N] over consecutive tiles of `tile` entries, the last one padded."""
    count = -(-values.shape[0] // tile)
    padding = count * tile - values.shape[0]
    low = torch.cat([values, values.new_full((padding,), high_fill)]).view(count, tile).amin(1)
    high = torch.cat([values, values.new_full((padding,), low_fill)]).view(count, tile).amax(1)
    return low, high


def dflash_block_mask(context_sequence: torch.Tensor, context_positions: torch.Tensor, block_sequence: torch.Tensor,
                      block_anchor: torch.Tensor, *, block_size: int, sliding_window: int | None = None):
    """`dflash_mask` as a flex-attention BlockMask, from per-key and per-block metadata only.

    context_sequence / context_positions [C] per key, block_sequence / block_anchor [blocks] per
    block (queries are blocks * block_size, block by block). Which 128 x 128 tiles can hold a
    visible pair follows from each tile's range of sequences, positions and anchors (sequences
    are packed contiguously, so the ranges are tight); the rule itself (`visible`) decides inside
    those tiles, and a tile where it holds everywhere is marked full and skips it. A few
    whole-tensor ops on the metadata's device: the dense [Q, C + Q] matrix never exists, and
    nothing is read back to the host.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device, tile = context_sequence.device, FLEX_TILE
    context, queries = context_sequence.shape[0], block_sequence.shape[0] * block_size
    query_sequence = block_sequence.repeat_interleave(block_size)
    query_anchor = block_anchor.repeat_interleave(block_size)

    def visible(batch, head, query, key):
        block = query // block_size
        row = key.clamp(max=context - 1)
        anchor = block_anchor[block]
        seen = (key < context) & (context_sequence[row] == block_sequence[block]) & (context_positions[row] < anchor)
        if sliding_window is not None:
            seen = seen & (context_positions[row] >= anchor - sliding_window)
        return seen | ((key >= context) & ((key - context) // block_size == block))

    big = 1 << 40
    q_seq_low, q_seq_high = _tile_range(query_sequence, tile, -big, big)
    anchor_low, anchor_high = _tile_range(query_anchor, tile, -big, big)
    k_seq_low, k_seq_high = _tile_range(context_sequence, tile, -big, big)
    pos_low, pos_high = _tile_range(context_positions, tile, -big, big)
    query_tiles, kv_tiles = q_seq_low.shape[0], -(-(context + queries) // tile)
    context_tiles = k_seq_low.shape[0]
    # Context tiles: a visible pair needs a shared sequence and a key position before some anchor
    # (and, with a window, not too far before every anchor): a superset of the true tiles.
    maybe = (q_seq_low[:, None] <= k_seq_high[None]) & (k_seq_low[None] <= q_seq_high[:, None]) & (pos_low[None] < anchor_high[:, None])
    # Full: one sequence on both sides, every key before every anchor, whole tiles only.
    whole_query = torch.arange(query_tiles, device=device) * tile + tile <= queries
    whole_key = torch.arange(context_tiles, device=device) * tile + tile <= context
    full = ((q_seq_low == q_seq_high)[:, None] & (k_seq_low == k_seq_high)[None] & (q_seq_low[:, None] == k_seq_low[None])
            & (q_seq_low >= 0)[:, None] & (pos_high[None] < anchor_low[:, None]) & whole_query[:, None] & whole_key[None])
    if sliding_window is not None:
        maybe &= pos_high[None] >= anchor_low[:, None] - sliding_window
        full &= pos_low[None] >= anchor_high[:, None] - sliding_window
    partial = torch.zeros(query_tiles, kv_tiles, dtype=torch.bool, device=device)
    partial[:, :context_tiles] = maybe & ~full
    full_all = torch.zeros_like(partial)
    full_all[:, :context_tiles] = full
    # Own-block keys: query tile i holds queries [i*T, (i+1)*T), whose block keys are C + the same range.
    first_query = torch.arange(query_tiles, device=device) * tile
    first = (context + first_query) // tile
    last = (context + torch.clamp(first_query + tile, max=queries) - 1) // tile
    columns = torch.arange(kv_tiles, device=device)
    partial |= (columns[None] >= first[:, None]) & (columns[None] <= last[:, None])
    partial &= ~full_all

    def as_indices(chosen: torch.Tensor):
        order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)  # chosen tiles first, ascending
        return chosen.sum(1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    kv_num, kv_indices = as_indices(partial)
    full_num, full_indices = as_indices(full_all)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=tile, mask_mod=visible,
                                    seq_lengths=(queries, context + queries))
