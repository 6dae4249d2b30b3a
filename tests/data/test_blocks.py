"""data/blocks.py: anchors (answer text followed by answer text, drawn per sequence from its own
seed), and a packed batch in which no block sees another sequence's context (training adds its weights
and distillation targets: train/loss.py)."""

import pytest
import torch

from dflash_pipeline.data.blocks import (
    build_batch,
    draw_anchors,
    scoring_anchor_seed,
    training_anchor_seed,
    valid_anchors,
)
from dflash_pipeline.data.shards import Sample
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.train.loss import training_targets


def sample(ids, mask, *, width=4, top_k=0):
    ids = torch.tensor(ids)
    topk = {}
    if top_k:
        topk = dict(target_topk_ids=torch.arange(len(ids) * top_k).view(len(ids), top_k),
                    target_topk_logprobs=-torch.ones(len(ids), top_k))
    return Sample("s", ids, torch.tensor(mask, dtype=torch.uint8), ids, torch.zeros(len(ids), width), **topk)


def test_anchor_seeds_differ_by_step_position_and_sequence_but_never_by_batch():
    seeds = {training_anchor_seed(0, step, position) for step in range(5) for position in range(5)}
    assert len(seeds) == 25
    assert scoring_anchor_seed(0, 3) == scoring_anchor_seed(0, 3) != scoring_anchor_seed(1, 3)


def test_anchors_are_drawn_without_replacement_in_ascending_order():
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0, 1, 1])
    assert valid_anchors(mask).tolist() == [1, 2, 3, 4, 5, 8]
    drawn = draw_anchors(mask, 4, seed=3)
    assert drawn == sorted(set(drawn)) and len(drawn) == 4 and set(drawn) <= {1, 2, 3, 4, 5, 8}
    assert draw_anchors(mask, 4, seed=3) == drawn
    assert draw_anchors(mask, 100, seed=0) == [1, 2, 3, 4, 5, 8]
    assert draw_anchors(torch.tensor([1, 0, 1, 0]), 3, seed=0) == []


def test_packed_sequences_never_see_each_others_context():
    first, second = sample(list(range(10, 16)), [0, 1, 1, 1, 1, 1]), sample(list(range(20, 25)), [0, 0, 1, 1, 1])
    batch = build_batch([first, second], anchors_per_sequence=10, block_size=3, mask_token_id=0, anchor_seeds=[0, 1])
    assert batch.context_tokens == 11 and batch.block_sequence.tolist() == [0, 0, 0, 0, 1, 1]
    assert batch.anchors.tolist() == [1, 2, 3, 4, 2, 3]
    context = batch.mask[:, :11]
    queries = batch.block_sequence.repeat_interleave(3)
    assert not context[queries == 0][:, 6:].any() and not context[queries == 1][:, :6].any()
    # the block at anchor 2 of the second sequence sees its positions 0 and 1 only (< the anchor)
    assert context[3 * 4:3 * 5, 6:].tolist() == [[True, True, False, False, False]] * 3


def test_soft_targets_are_the_targets_distribution_one_position_before_each_slot():
    one = sample(list(range(10, 16)), [0, 1, 1, 1, 1, 1], top_k=2)
    batch = build_batch([one], anchors_per_sequence=1, block_size=3, mask_token_id=0, anchor_seeds=[0])
    anchor = int(batch.anchors[0])
    targets = training_targets(batch, [one], 1.0, block_size=3)
    assert targets.soft_ids[0].tolist() == [one.target_topk_ids[anchor].tolist(), one.target_topk_ids[anchor + 1].tolist()]
    plain = sample(list(range(6)), [0, 1, 1, 1, 1, 1])
    without = training_targets(build_batch([plain], anchors_per_sequence=1, block_size=3, mask_token_id=0, anchor_seeds=[0]), [plain], 1.0, block_size=3)
    assert without.soft_ids is None and without.soft_logprobs is None
    assert not hasattr(batch, "weights") and not hasattr(batch, "soft_ids")  # training's fields are training's to build


def test_a_batch_without_any_anchor_is_one_line():
    with pytest.raises(PipelineError, match="no sequence in this batch has two answer tokens in a row"):
        build_batch([sample([1, 2, 3], [1, 0, 1])], anchors_per_sequence=4, block_size=3, mask_token_id=0, anchor_seeds=[0])


def test_the_sliding_window_masks_context_before_the_anchor():
    windowed_sample = sample(list(range(10, 22)), [0, 0] + [1] * 10)
    full = build_batch([windowed_sample], anchors_per_sequence=3, block_size=4, mask_token_id=99, anchor_seeds=[1])
    windowed = build_batch([windowed_sample], anchors_per_sequence=3, block_size=4, mask_token_id=99, anchor_seeds=[1],
                           sliding_window=3)
    anchors = windowed.block_positions.view(-1, 4)[:, 0].repeat_interleave(4)
    keys = torch.arange(12)
    visible = windowed.mask[:, :12]
    assert torch.equal(visible, full.mask[:, :12] & (keys[None, :] >= anchors[:, None] - 3))
    assert visible.sum() < full.mask[:, :12].sum() and torch.equal(windowed.mask[:, 12:], full.mask[:, 12:])
