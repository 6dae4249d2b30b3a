"""The device draft tree (issue #28): `build_draft_tree_tensors` grows the same tree as the host's
`build_draft_tree` (random inputs and inputs full of ties), reads nothing back from the device,
compiles to one graph of static shapes; `tree_attention_visibility` equals the visible part of
`tree_attention_mask`."""

import math
import random

import pytest
import torch

from dflash_pipeline.decoding.trees import (
    ANCHOR,
    PADDING,
    DraftTree,
    RankPathKeys,
    build_draft_tree,
    build_draft_tree_tensors,
    ranked_candidates,
    tree_attention_mask,
    tree_attention_visibility,
)
from test_step_contract import DeviceReads

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
