"""The device draft tree (issue #28): `build_draft_tree_tensors` grows the same tree as the host's
`build_draft_tree` (random inputs and inputs full of ties), one block or a batch of blocks in
lockstep, reads nothing back from the device, compiles to one graph of static shapes;
`tree_streaks` walks the batched trees as `DraftTree.streak` walks each; `tree_attention_visibility`
equals the visible part of `tree_attention_mask`."""

import math
import random

import numpy as np
import pytest
import torch
from oracles.trees import DraftTree, build_draft_tree, tree_attention_mask
from support.device_reads import DeviceReads

from dflash_pipeline.speculation.trees import (
    ANCHOR,
    PADDING,
    RankPathKeys,
    build_draft_tree_tensors,
    ranked_candidates,
    tree_attention_visibility,
    tree_streaks,
)

SLOTS = (1, 3, 7, 15)
WIDTHS = (1, 2, 4, 8, 16)
BUDGETS = (1, 4, 8, 16, 32, 64)


def host_tree(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTree:
    """The host builder on the inputs as the tree proposer hands them over (float64 Python floats)."""
    return build_draft_tree(logprobs.double().tolist(), token_ids.tolist(), budget)


def device_tree(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DraftTree:
    return DraftTree.from_tensors(build_draft_tree_tensors(logprobs, token_ids, budget))


def assert_same_tree(logprobs, token_ids, budget, what=""):
    expected, got = host_tree(logprobs, token_ids, budget), device_tree(logprobs, token_ids, budget)
    assert (got.tokens, got.parents, got.depths) == (expected.tokens, expected.parents, expected.depths), \
        f"{what} D={logprobs.shape[0]} K={logprobs.shape[1]} budget={budget}"


def distinct_ids(slots: int, width: int, generator) -> torch.Tensor:
    """Token ids, distinct within a slot (as a top-K is), from a vocabulary of 1,000."""
    return torch.stack([torch.randperm(1000, generator=generator)[:width] for _ in range(slots)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_device_tree_equals_the_host_tree_on_random_inputs(seed):
    """Unsorted random log-probs (the builders do not rely on the order) and sorted ones from
    `ranked_candidates`, for every D, K and budget of the grid, budgets past D * K included
    (there the tree runs out of candidates: count < budget)."""
    generator = torch.Generator().manual_seed(seed)
    for slots in SLOTS:
        for width in WIDTHS:
            token_ids = distinct_ids(slots, width, generator)
            unsorted = torch.randn(slots, width, generator=generator) * 3
            sorted_logprobs, sorted_ids = ranked_candidates(torch.randn(slots, 50, generator=generator) * 2, width)
            for budget in BUDGETS:
                assert_same_tree(unsorted, token_ids, budget, "unsorted")
                assert_same_tree(sorted_logprobs, sorted_ids, budget, "ranked")


@pytest.mark.parametrize("seed", [0, 1])
def test_the_device_tree_equals_the_host_tree_on_inputs_full_of_ties(seed):
    """Ties decided by the rank path alone: log-probs from a tiny set (log 1/2, log 1/4; exact
    dyadic values whose sums tie exactly), every row equal, all zeros, -inf among them, and
    `ranked_candidates` of integer logits with many equal values."""
    generator = torch.Generator().manual_seed(seed)
    halves = torch.tensor([math.log(0.5), math.log(0.25)])
    dyadic = torch.tensor([0.0, -0.5, -1.0, -2.0])
    for slots in SLOTS:
        for width in WIDTHS:
            token_ids = distinct_ids(slots, width, generator)
            inputs = {
                "halves": halves[torch.randint(0, 2, (slots, width), generator=generator)],
                "dyadic": dyadic[torch.randint(0, 4, (slots, width), generator=generator)],
                "equal rows": dyadic[torch.randint(0, 4, (1, width), generator=generator)].expand(slots, width),
                "zeros": torch.zeros(slots, width),
                "-inf": torch.tensor([0.0, -1.0, -math.inf])[torch.randint(0, 3, (slots, width), generator=generator)],
            }
            tied_logprobs, tied_ids = ranked_candidates(torch.randint(0, 3, (slots, 20), generator=generator).float(), width)
            for budget in BUDGETS:
                for what, logprobs in inputs.items():
                    assert_same_tree(logprobs, token_ids, budget, what)
                assert_same_tree(tied_logprobs, tied_ids, budget, "ranked ties")


def test_wide_candidates_use_two_rank_keys_and_still_break_ties_exactly():
    """K = budget = 64 at D = 15 needs two int64 keys per rank path: with all log-probs equal the
    pops run down the rank-0 chain and then across the deepest slots' siblings, whose paths differ
    only in the second key."""
    assert RankPathKeys.for_sizes(15, 16, 16).chunks == 1
    assert RankPathKeys.for_sizes(15, 16, 64).chunks == 1
    assert RankPathKeys.for_sizes(15, 64, 64).chunks == 2
    generator = torch.Generator().manual_seed(3)
    token_ids = distinct_ids(15, 64, generator)
    for logprobs in (torch.zeros(15, 64), torch.tensor([0.0, -1.0])[torch.randint(0, 2, (15, 64), generator=generator)],
                     torch.randn(15, 64, generator=generator)):
        for budget in (16, 48, 64):
            assert_same_tree(logprobs, token_ids, budget)
    tree = device_tree(torch.zeros(15, 64), token_ids, 64)
    assert tree.depths == list(range(15)) + [14] * 49


def test_rank_path_keys_order_paths_as_python_tuples():
    """The encoding behind the tie-break, on random paths within its bounds (ranks <= min(K, budget),
    at most D long): sorting by keys sorts the paths, prefixes before their extensions, and no key
    reaches the sentinel."""
    rng = random.Random(0)
    for slots, width, budget in ((15, 16, 16), (15, 64, 64), (3, 2, 64), (15, 1, 64), (7, 300, 300)):
        keys = RankPathKeys.for_sizes(slots, width, budget)
        top = min(width, budget)
        paths = {tuple(rng.randint(0, top) for _ in range(rng.randint(1, slots))) for _ in range(3000)}
        paths |= {path[:cut] for path in list(paths) for cut in range(1, len(path))}
        encoded = {path: keys.encode(path) for path in paths}
        assert sorted(paths) == sorted(paths, key=encoded.get)
        assert all(0 <= key < 2**63 - 1 for codes in encoded.values() for key in codes)


def test_a_budget_past_the_candidates_pads_the_tree():
    token_ids = torch.tensor([[5, 6], [7, 8]])
    tree = build_draft_tree_tensors(torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]), token_ids, 8)
    assert int(tree.count) == 6  # 2 + 2 * 2 prefixes
    assert tree.tokens[6:].tolist() == [0, 0] and tree.parents[6:].tolist() == [PADDING] * 2 and tree.depths[6:].tolist() == [-1] * 2
    assert tree.parents[:6].tolist() == [ANCHOR, ANCHOR, 0, 0, 1, 1] and tree.depths[:6].tolist() == [0, 0, 1, 1, 1, 1]
    empty = build_draft_tree_tensors(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int64), 4)
    assert int(empty.count) == 0 and empty.parents.tolist() == [PADDING] * 4
    assert len(DraftTree.from_tensors(build_draft_tree_tensors(torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.int64), 0))) == 0


def sample_trees(seed: int, count: int, slots: int, width: int, budget: int):
    """`count` inputs of one shape: a mix of random and tied log-probs."""
    generator = torch.Generator().manual_seed(seed)
    for number in range(count):
        if number % 2:
            logits = torch.randint(0, 3, (slots, 40), generator=generator).float()
        else:
            logits = torch.randn(slots, 40, generator=generator)
        yield ranked_candidates(logits, width)


def assert_visibility_equals_the_host_mask(tree, past: int, slots: int):
    visible = tree_attention_visibility(tree.parents, past, slots)
    budget, count = tree.parents.shape[0], int(tree.count)
    assert visible.shape == (1 + budget, past + 1 + budget) and visible.dtype == torch.bool
    host = tree_attention_mask(DraftTree.from_tensors(tree), past, torch.float32, "cpu")[0, 0] == 0
    assert torch.equal(visible[: 1 + count, : past + 1 + count], host)
    assert not visible[: 1 + count, past + 1 + count :].any()  # no node of the tree sees padding
    padding_rows = visible[1 + count :]  # padding: the cache, the anchor and itself
    expected = torch.zeros_like(padding_rows)
    expected[:, : past + 1] = True
    expected[torch.arange(budget - count), past + 1 + count + torch.arange(budget - count)] = True
    assert torch.equal(padding_rows, expected)


@pytest.mark.parametrize(("slots", "width", "budget"), [(1, 4, 8), (3, 2, 64), (7, 4, 16), (15, 16, 16), (15, 8, 64)])
def test_the_visibility_matrix_equals_the_host_masks_visible_part(slots, width, budget):
    for past in (0, 5):
        for logprobs, token_ids in sample_trees(slots * 100 + budget, 6, slots, width, budget):
            assert_visibility_equals_the_host_mask(build_draft_tree_tensors(logprobs, token_ids, budget), past, slots)


def test_building_the_tree_and_its_visibility_reads_nothing_back():
    inputs = list(sample_trees(7, 4, 15, 16, 16)) + list(sample_trees(8, 2, 3, 2, 64))
    with DeviceReads() as reads:
        for logprobs, token_ids in inputs:
            tree = build_draft_tree_tensors(logprobs, token_ids, 16 if logprobs.shape[0] == 15 else 64)
            tree_attention_visibility(tree.parents, past=9, max_depth=logprobs.shape[0])
    assert reads.calls == []


def test_the_compiled_builder_is_one_graph_that_never_recompiles():
    """fullgraph=True, dynamic=False: twelve inputs of one shape (random and tied) reuse one graph
    with no graph break, and give the host builder's trees and the host mask's visibility."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    slots, width, budget, past = 15, 16, 16, 4

    def build(logprobs, token_ids):
        tree = build_draft_tree_tensors(logprobs, token_ids, budget)
        return tree.tokens, tree.parents, tree.depths, tree.count, tree_attention_visibility(tree.parents, past, slots)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(build, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for logprobs, token_ids in sample_trees(11, 12, slots, width, budget):
            tokens, parents, depths, count, visible = compiled(logprobs, token_ids)
            expected = host_tree(logprobs, token_ids, budget)
            assert (tokens[:count].tolist(), parents[:count].tolist(), depths[:count].tolist()) == \
                (expected.tokens, expected.parents, expected.depths)
            host_visible = tree_attention_mask(expected, past, torch.float32, "cpu")[0, 0] == 0
            assert torch.equal(visible[: 1 + int(count), : past + 1 + int(count)], host_visible)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


# ----------------------------------------------------------------------------- many blocks at once


def batch_of_inputs(seed: int, blocks: int, slots: int, width: int):
    """[blocks, D, K] log-probs of every kind the builders must agree on, and distinct ids per slot:
    random; rounded to one decimal (many equal sums); each block's rows all equal; all equal;
    random with -inf entries; all -inf but the first candidate of each slot."""
    generator = torch.Generator().manual_seed(seed)
    random_values = torch.randn(blocks, slots, width, generator=generator) * 2
    kinds = {
        "random": random_values,
        "one decimal": (random_values.clamp(max=0) * 10).round() / 10,
        "equal rows": (torch.randn(blocks, 1, width, generator=generator) * 10).round().div(10).expand(blocks, slots, width),
        "all equal": torch.full((blocks, slots, width), -0.5),
        "-inf": random_values.masked_fill(torch.rand(blocks, slots, width, generator=generator) < 0.3, -math.inf),
        "-inf but the first": torch.full((blocks, slots, width), -math.inf).index_fill(2, torch.tensor([0]), -1.0),
    }
    token_ids = torch.stack([distinct_ids(slots, width, generator) for _ in range(blocks)])
    return kinds, token_ids


@pytest.mark.parametrize(("slots", "width"), [(1, 1), (1, 5), (2, 2), (3, 4), (4, 3), (7, 2), (15, 8), (15, 20)])
def test_the_batched_builder_grows_each_blocks_host_tree(slots, width):
    """Block by block the batched tree is `build_draft_tree`'s (nodes, parents, depths, count, the
    padding past it), for budgets up to past D * K (where the candidates run out) and for every kind
    of ties; the blocks of one batch differ, so no block's growth leaks into another's. D = 15,
    K = 20 takes two rank-path keys from budget 20 on."""
    kinds, token_ids = batch_of_inputs(slots * 10 + width, 12, slots, width)
    for what, logprobs in kinds.items():
        for budget in (1, 2, 5, 16, slots * width + 3):
            tree = build_draft_tree_tensors(logprobs, token_ids, budget)
            assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (12, budget) and tree.count.shape == (12,)
            for block in range(12):
                expected = host_tree(logprobs[block], token_ids[block], budget)
                count = int(tree.count[block])
                assert count == len(expected), (what, budget, block)
                got = (tree.tokens[block, :count].tolist(), tree.parents[block, :count].tolist(), tree.depths[block, :count].tolist())
                assert got == (expected.tokens, expected.parents, expected.depths), (what, budget, block)
                assert tree.parents[block, count:].eq(PADDING).all() and tree.depths[block, count:].eq(-1).all(), (what, budget, block)


def test_one_block_keeps_unbatched_shapes_and_equals_its_row_of_a_batch():
    kinds, token_ids = batch_of_inputs(5, 3, 4, 6)
    logprobs = kinds["one decimal"]
    batched = build_draft_tree_tensors(logprobs, token_ids, 10)
    for block in range(3):
        alone = build_draft_tree_tensors(logprobs[block], token_ids[block], 10)
        assert alone.tokens.shape == alone.parents.shape == alone.depths.shape == (10,) and alone.count.shape == ()
        assert torch.equal(alone.tokens, batched.tokens[block]) and torch.equal(alone.parents, batched.parents[block])
        assert torch.equal(alone.depths, batched.depths[block]) and torch.equal(alone.count, batched.count[block])
    empty = build_draft_tree_tensors(torch.zeros(0, 3, 4), torch.zeros(0, 3, 4, dtype=torch.int64), 6)
    assert empty.tokens.shape == (0, 6) and empty.count.shape == (0,)
    no_slots = build_draft_tree_tensors(torch.zeros(2, 0, 4), torch.zeros(2, 0, 4, dtype=torch.int64), 3)
    assert no_slots.parents.tolist() == [[PADDING] * 3] * 2 and no_slots.count.tolist() == [0, 0]


def test_the_batched_builder_reads_nothing_back():
    kinds, token_ids = batch_of_inputs(6, 5, 7, 4)
    with DeviceReads() as reads:
        tree = build_draft_tree_tensors(kinds["-inf"], token_ids, 16)
        tree_streaks(tree, token_ids[:, :, 0], torch.full((5,), 7), [1, 8, 16])
    assert reads.calls == []


@pytest.mark.parametrize(("slots", "width"), [(1, 3), (2, 2), (3, 4), (4, 3), (7, 2), (15, 8)])
def test_tree_streaks_equal_the_host_trees_walk_for_every_budget(slots, width):
    """References that follow some candidate (mostly the first, often another), sometimes a token no
    candidate has, cut to random lengths (0 to D); budgets from 0 past D * K, out of order, as
    `DraftTree.streak` of the host tree of that budget walks them."""
    blocks = 40
    kinds, token_ids = batch_of_inputs(slots * 7 + width, blocks, slots, width)
    rng = np.random.default_rng(slots * 100 + width)
    chosen = torch.as_tensor(np.where(rng.random((blocks, slots)) < 0.6, 0, rng.integers(0, width, (blocks, slots))))  # mostly the first
    reference = token_ids.gather(2, chosen[..., None])[..., 0]
    reference = torch.where(torch.as_tensor(rng.random((blocks, slots)) < 0.1), 1000, reference)  # no candidate's token
    length = torch.as_tensor(rng.integers(0, slots + 1, blocks))
    budgets = [5, 0, 1, 2, 16, slots * width + 3]
    for what, logprobs in kinds.items():
        tree = build_draft_tree_tensors(logprobs, token_ids, max(budgets))
        streaks = tree_streaks(tree, reference, length, budgets)
        assert sorted(streaks) == sorted(budgets)
        for budget in budgets:
            assert streaks[budget].dtype == torch.int64 and streaks[budget].shape == (blocks,)
            expected = [host_tree(logprobs[block], token_ids[block], budget).streak(reference[block, : length[block]].tolist())
                        for block in range(blocks)]
            assert streaks[budget].tolist() == expected, (what, budget)
        assert streaks[max(budgets)].max() >= min(slots, 2), what  # the walks reach past the first slot
