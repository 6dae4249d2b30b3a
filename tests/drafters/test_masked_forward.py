"""The drafter: the packed DFlash mask against a plain per-block loop, and the inference cache."""

import pytest
import torch
from oracles.drafting import DraftCache, draft_block
from support.blocks import VOCAB, block_ids, packed_blocks, reference_block

from dflash_pipeline.data.masks import dflash_mask
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.target.load import TargetHead
from dflash_pipeline.train.loss import decay_weights, default_gamma


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, vocab_size=VOCAB, block_size=4, target_layer_ids=(0, 2, 3), num_target_layers=4,
                  mask_token_id=VOCAB - 1, rope_theta=10000.0)
    values.update(overrides)
    return DrafterConfig(**values)


@pytest.fixture
def drafter_and_head():
    torch.manual_seed(0)
    config = tiny_config()
    drafter = DFlashDrafter(config).eval()
    for norm in [m for m in drafter.modules() if m.__class__.__name__ == "RMSNorm"]:
        norm.weight.data.uniform_(0.5, 1.5)  # not all ones, so a misplaced norm shows up
    head = TargetHead(torch.randn(VOCAB, 32), torch.randn(VOCAB, 32))
    return drafter, head


def test_packed_masked_forward_equals_one_block_at_a_time(drafter_and_head):
    drafter, head = drafter_and_head
    torch.manual_seed(1)
    width = drafter.config.feature_width
    sequences = [(torch.randn(n, width), torch.randint(0, VOCAB - 1, (n,))) for n in (11, 7, 15)]
    anchors = [[1, 4, 9], [2, 6], [3, 5, 12, 13]]
    packed = packed_blocks(drafter, head, sequences, anchors)
    expected = torch.stack([reference_block(drafter, head, f, ids, a)
                            for (f, ids), sequence_anchors in zip(sequences, anchors) for a in sequence_anchors])
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


def test_mask_matches_its_definition_entry_by_entry():
    context_sequence = torch.tensor([0, 0, 0, 1, 1])
    context_positions = torch.tensor([0, 1, 2, 0, 1])
    # Two blocks of size 2: sequence 0 anchored at 2, sequence 1 anchored at 1.
    mask = dflash_mask(context_sequence, context_positions, torch.tensor([0, 0, 1, 1]), torch.tensor([2, 2, 1, 1]),
                       torch.tensor([0, 0, 1, 1]))
    expected = torch.tensor([
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 1, 1],
        [0, 0, 0, 1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    windowed = dflash_mask(context_sequence, context_positions, torch.tensor([0]), torch.tensor([2]), torch.tensor([0]),
                           sliding_window=1)
    assert windowed[0, :5].tolist() == [False, True, False, False, False]


def test_changing_a_later_context_token_does_not_change_a_block(drafter_and_head):
    drafter, head = drafter_and_head
    torch.manual_seed(2)
    features, ids = torch.randn(12, drafter.config.feature_width), torch.randint(0, VOCAB - 1, (12,))
    before = packed_blocks(drafter, head, [(features, ids)], [[5]])
    features[5:] = torch.randn(7, drafter.config.feature_width)  # the anchor's own feature and later
    after = packed_blocks(drafter, head, [(features, ids)], [[5]])
    torch.testing.assert_close(before, after)
    features[4] += 1.0
    assert not torch.allclose(before, packed_blocks(drafter, head, [(features, ids)], [[5]]))


def test_inference_cache_gives_the_training_forward(drafter_and_head):
    drafter, head = drafter_and_head
    torch.manual_seed(3)
    features, ids = torch.randn(14, drafter.config.feature_width), torch.randint(0, VOCAB - 1, (14,))
    cache = DraftCache(drafter)
    cache.extend(features[:6])
    cache.extend(features[6:9])  # grown in two steps, as committed tokens arrive
    logits = draft_block(drafter, head, cache, int(ids[9]))
    expected = head.logits(reference_block(drafter, head, features, ids, 9)[1:])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    cache.crop(4)
    torch.testing.assert_close(draft_block(drafter, head, cache, int(ids[4])),
                               head.logits(reference_block(drafter, head, features, ids, 4)[1:]), rtol=1e-5, atol=1e-5)


def test_decay_weights():
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0
    weights = decay_weights(8, 4.0)
    assert weights.shape == (7,) and weights[0] == 1.0
    torch.testing.assert_close(weights[1] / weights[0], torch.tensor(torch.e ** -0.25))


def test_flex_attention_path_equals_sdpa_and_the_reference(drafter_and_head):
    drafter, head = drafter_and_head
    torch.manual_seed(4)
    width = drafter.config.feature_width
    features, ids = torch.randn(40, width), torch.randint(0, VOCAB - 1, (40,))
    anchors = [3, 9, 17, 30, 36]
    config = drafter.config
    embeddings = torch.cat([head.embed(block_ids(int(ids[a]), config)) for a in anchors])
    positions = torch.cat([torch.arange(a, a + config.block_size) for a in anchors])
    block_anchor = torch.cat([torch.full((config.block_size,), a) for a in anchors])
    block_index = torch.arange(len(anchors)).repeat_interleave(config.block_size)
    mask = dflash_mask(torch.zeros(40, dtype=torch.long), torch.arange(40), torch.zeros_like(block_anchor), block_anchor, block_index)
    with torch.no_grad():
        sdpa = drafter.forward_blocks(features, torch.arange(40), embeddings, positions, mask, attention="sdpa")
        flex = drafter.forward_blocks(features, torch.arange(40), embeddings, positions, mask, attention="flex")
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    expected = torch.cat([reference_block(drafter, head, features, ids, a) for a in anchors])
    torch.testing.assert_close(flex, expected, rtol=1e-5, atol=1e-5)
