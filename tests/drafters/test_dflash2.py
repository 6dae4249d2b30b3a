"""DFlash2: the block-local convolution and the candidate selector against plain-loop definitions, the
packed forward against one block at a time, and the config's serialised form."""

import pytest
import torch
from oracles.drafting import DraftCache, draft_block, draft_hidden, select_block
from support.blocks import block_ids
from support.drafters import randomize

from dflash_pipeline.data.masks import dflash_mask
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.dflash2 import (
    CandidateSelector,
    block_causal_conv,
    select_paths,
)
from dflash_pipeline.target.load import TargetHead

VOCAB = 97


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, vocab_size=VOCAB, block_size=4, target_layer_ids=(0, 2, 3), num_target_layers=4,
                  mask_token_id=VOCAB - 1, rope_theta=10000.0, architecture="dflash2")
    options = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)
    options.update({key: overrides.pop(key) for key in list(overrides) if key in options})
    values.update(overrides)
    return DrafterConfig(**values, options=options if values["architecture"] == "dflash2" else None)


@pytest.fixture
def drafter_and_head():
    torch.manual_seed(0)
    drafter = randomize(DFlashDrafter(tiny_config()))
    return drafter, TargetHead(torch.randn(VOCAB, 32), torch.randn(VOCAB, 32))




# ----------------------------------------------------------------------------- the convolution


def test_block_causal_conv_matches_its_definition_entry_by_entry():
    torch.manual_seed(0)
    blocks, length, hidden, taps, group = 3, 5, 8, 3, 4
    x, base = torch.randn(blocks, length, hidden), torch.randn(taps, hidden)
    dynamic = torch.randn(blocks, length, taps, hidden // group)
    expected = torch.zeros_like(x)
    for b in range(blocks):
        for t in range(length):
            for c in range(hidden):
                for o in range(taps):
                    if t - o >= 0:  # nothing before the block's first slot
                        expected[b, t, c] += (base[o, c] + dynamic[b, t, o, c // group]) * x[b, t - o, c]
    torch.testing.assert_close(block_causal_conv(x, base, dynamic, group), expected)
    # More taps than positions: the extra taps reach nothing.
    torch.testing.assert_close(block_causal_conv(x[:, :2], base, dynamic[:, :2], group), expected[:, :2])


def test_an_untrained_dflash2_layer_computes_the_dflash_layer_it_wraps():
    torch.manual_seed(0)
    plain = DFlashDrafter(tiny_config(architecture="dflash")).eval()
    wrapped = DFlashDrafter(tiny_config()).eval()
    missing, unexpected = wrapped.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("conv" in name or "candidate_selector" in name for name in missing)
    head = TargetHead(torch.randn(VOCAB, 32), torch.randn(VOCAB, 32))
    features = torch.randn(9, plain.config.feature_width)
    caches = [DraftCache(plain), DraftCache(wrapped)]
    for cache in caches:
        cache.extend(features)
    torch.testing.assert_close(draft_block(wrapped, head, caches[1], 5), draft_block(plain, head, caches[0], 5))
    randomize(wrapped)
    assert not torch.allclose(draft_block(wrapped, head, caches[1], 5), draft_block(plain, head, caches[0], 5))


# ----------------------------------------------------------------------------- packed forward


def reference_block(drafter, head, features, ids, anchor):
    """One block, the obvious way: its context is exactly features[:anchor], everything visible."""
    config = drafter.config
    with torch.no_grad():
        return drafter.forward_blocks(features[:anchor], torch.arange(anchor), head.embed(block_ids(int(ids[anchor]), config)),
                                      torch.arange(anchor, anchor + config.block_size), mask=None)


def test_packed_forward_equals_one_block_at_a_time_and_the_inference_cache(drafter_and_head):
    drafter, head = drafter_and_head
    config, width = drafter.config, drafter.config.feature_width
    torch.manual_seed(1)
    sequences = [(torch.randn(n, width), torch.randint(0, VOCAB - 1, (n,))) for n in (11, 7, 15)]
    anchors = [[1, 4, 5, 9], [2, 3], [3, 5, 12, 13]]  # neighbouring anchors: blocks that overlap in position
    features = torch.cat([f for f, _ in sequences])
    context_positions = torch.cat([torch.arange(len(f)) for f, _ in sequences])
    context_sequence = torch.cat([torch.full((len(f),), s) for s, (f, _) in enumerate(sequences)])
    embeddings, positions, sequence_of, anchor_of = [], [], [], []
    for s, ((_, ids), sequence_anchors) in enumerate(zip(sequences, anchors)):
        for anchor in sequence_anchors:
            embeddings.append(head.embed(block_ids(int(ids[anchor]), config)))
            positions.append(torch.arange(anchor, anchor + config.block_size))
            sequence_of.append(torch.full((config.block_size,), s))
            anchor_of.append(torch.full((config.block_size,), anchor))
    count = len(embeddings)
    mask = dflash_mask(context_sequence, context_positions, torch.cat(sequence_of), torch.cat(anchor_of),
                       torch.arange(count).repeat_interleave(config.block_size))
    with torch.no_grad():
        packed = drafter.forward_blocks(features, context_positions, torch.cat(embeddings), torch.cat(positions), mask)
    expected = torch.cat([reference_block(drafter, head, f, ids, a) for (f, ids), seq in zip(sequences, anchors) for a in seq])
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)

    features_0, ids_0 = sequences[0]
    cache = DraftCache(drafter)
    cache.extend(features_0[:5])
    torch.testing.assert_close(draft_block(drafter, head, cache, int(ids_0[5])),
                               head.logits(reference_block(drafter, head, features_0, ids_0, 5)[1:]), rtol=1e-5, atol=1e-5)


def test_no_tap_crosses_from_one_block_into_the_next(drafter_and_head):
    drafter, head = drafter_and_head
    config = drafter.config
    features = torch.randn(12, config.feature_width)
    ids = torch.randint(0, VOCAB - 1, (12,))

    def two_blocks(first_anchor_token):
        embeddings = torch.cat([head.embed(block_ids(first_anchor_token, config)), head.embed(block_ids(int(ids[6]), config))])
        anchor_of = torch.tensor([6] * config.block_size * 2)
        mask = dflash_mask(torch.zeros(12, dtype=torch.long), torch.arange(12), torch.zeros(8, dtype=torch.long), anchor_of,
                           torch.arange(2).repeat_interleave(config.block_size))
        positions = torch.arange(6, 6 + config.block_size).repeat(2)
        with torch.no_grad():
            return drafter.forward_blocks(features, torch.arange(12), embeddings, positions, mask).view(2, config.block_size, -1)

    # Same anchor position, different anchor token in block 0: block 1 (right after it in the
    # packed layout) must not see it through a convolution tap.
    before, after = two_blocks(3), two_blocks(40)
    assert not torch.allclose(before[0], after[0])
    torch.testing.assert_close(before[1], after[1], rtol=0, atol=0)


# ----------------------------------------------------------------------------- the selector


def plain_walk(selector: CandidateSelector, hidden, unary, candidates, anchor):
    """The walk written out: one slot, one candidate at a time."""
    path, predecessor = [], anchor
    for slot in range(hidden.shape[0]):
        context = selector.predecessor_codebook[predecessor] * (selector.hidden_projection.weight @ hidden[slot])
        scores = [float(unary[slot, k] + context @ selector.successor_codebook[candidates[slot, k]])
                  for k in range(candidates.shape[1])]
        predecessor = int(candidates[slot, max(range(len(scores)), key=scores.__getitem__)])
        path.append(predecessor)
    return path


def test_the_walk_is_the_argmax_of_unary_plus_pair_scores_given_the_path_so_far(drafter_and_head):
    drafter, head = drafter_and_head
    cache = DraftCache(drafter)
    cache.extend(torch.randn(8, drafter.config.feature_width))
    with torch.no_grad():
        chosen = select_block(drafter, head, cache, anchor_token=7)
        logits = draft_block(drafter, head, cache, 7)
    unary, candidates = logits.topk(drafter.config.options.selector_top_k, dim=-1)
    torch.testing.assert_close(chosen.unary[0], unary)
    assert torch.equal(chosen.candidates[0], candidates) and chosen.q is None
    with torch.no_grad():
        expected = plain_walk(drafter.candidate_selector, draft_hidden(drafter, head, cache, 7), unary, candidates, 7)
    assert chosen.tokens[0].tolist() == expected
    # The selector changes the draft here (its pair scores are not zero): not the per-slot argmax.
    assert chosen.tokens[0].tolist() != logits.argmax(-1).tolist()


def test_sampling_draws_from_softmax_of_the_scores_with_the_given_generator():
    torch.manual_seed(0)
    selector = CandidateSelector(hidden_size=8, vocab_size=20, rank=4, top_k=3)
    with torch.no_grad():
        selector.successor_codebook.normal_()
    hidden, logits = torch.randn(2, 5, 8), torch.randn(2, 5, 20)
    anchors = torch.tensor([3, 11])
    first = select_paths(selector, hidden, logits, anchors, temperature=0.7, generator=torch.Generator().manual_seed(5))
    again = select_paths(selector, hidden, logits, anchors, temperature=0.7, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.q, again.q)
    torch.testing.assert_close(first.q.sum(-1), torch.ones(2, 5))
    # q at each slot is softmax(score / T) given the drafted predecessor (the anchor at slot 0).
    predecessors = torch.cat([anchors[:, None], first.tokens[:, :-1]], dim=1)
    with torch.no_grad():
        scores = selector.pair_scores(hidden, first.unary, first.candidates, predecessors)
    torch.testing.assert_close(first.q, torch.softmax(scores / 0.7, dim=-1))
    assert bool((first.candidates == first.tokens[..., None]).any(-1).all())  # every draw is a candidate
    draws = {tuple(select_paths(selector, hidden, logits, anchors, temperature=5.0,
                                generator=torch.Generator().manual_seed(seed)).tokens[0].tolist()) for seed in range(20)}
    assert len(draws) > 1  # it samples


def test_a_draft_vocabulary_drafts_token_ids_and_indexes_the_codebooks_by_them():
    torch.manual_seed(0)
    drafter = randomize(DFlashDrafter(tiny_config(selector_top_k=3)))
    vocab = torch.tensor([4, 9, 17, 30, 41, 52, 60, 77])
    drafter.set_draft_vocab(vocab)
    head = TargetHead(torch.randn(VOCAB, 32), torch.randn(VOCAB, 32))
    cache = DraftCache(drafter)
    cache.extend(torch.randn(6, drafter.config.feature_width))
    chosen = select_block(drafter, head, cache, anchor_token=9)
    logits = draft_block(drafter, head, cache, 9)
    assert logits.shape == (3, 8)
    assert torch.equal(chosen.candidates[0], vocab[logits.topk(3, dim=-1).indices])
    assert set(chosen.tokens.flatten().tolist()) <= set(vocab.tolist())
    # The same drafter over the whole vocabulary, with these ids' rows only, walks the same path.
    with torch.no_grad():
        hidden = draft_hidden(drafter, head, cache, 9)
        full_logits = torch.full((3, VOCAB), -1e9)
        full_logits[:, vocab] = logits
        full = select_paths(drafter.candidate_selector, hidden[None], full_logits[None], torch.tensor([9]))
    assert torch.equal(full.tokens, chosen.tokens)


# ----------------------------------------------------------------------------- config


def test_a_dflash_config_serialises_as_before_and_dflash2_round_trips():
    dflash = tiny_config(architecture="dflash")
    assert not {"architecture", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} & set(dflash.to_dict())
    assert DrafterConfig.from_dict(dflash.to_dict()) == dflash
    dflash2 = tiny_config()
    assert dflash2.to_dict()["architecture"] == "dflash2" and DrafterConfig.from_dict(dflash2.to_dict()) == dflash2
    names = set(DFlashDrafter(dflash2).state_dict())
    assert {"layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names


@pytest.mark.parametrize("overrides, message", [
    (dict(conv_group_size=5), "conv_group_size 5 must divide hidden_size 32"),
    (dict(selector_top_k=0), "selector_top_k 0"),
    (dict(architecture="dflash3"), "architecture must be one of"),
])
def test_bad_dflash2_configs_fail_with_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)
