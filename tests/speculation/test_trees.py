"""Draft trees: the host oracles' tree mask against plain forwards and their tree decoding, lossless
where the answer lies off the drafter's top-1 chain (a scripted stand-in target); the engine's
DDTree decoding with a real drafter equals plain greedy (more in tests/decoding/test_static_speculation.py)."""

import pytest
import torch
from oracles.decoding import host_greedy_decode, host_speculative_decode
from oracles.drafting import Proposal
from oracles.trees import (
    ANCHOR,
    DraftTree,
    build_draft_tree,
    tree_attention_mask,
    tree_positions,
)
from support.decoding import plain_logits, prefilled

from dflash_pipeline.decoding.plain import greedy_decode
from dflash_pipeline.decoding.session import Speculation, speculative_decode
from dflash_pipeline.speculation.modes import DecodingMode


@pytest.fixture
def tiny_llama(tiny_target):
    return tiny_target[0]


def test_the_tree_mask_on_a_three_node_tree_equals_a_loop_of_plain_forwards(tiny_llama):
    # anchor -> 11 (node 0) -> 13 (node 2); anchor -> 12 (node 1): node 2 must not see its uncle
    tree = DraftTree(tokens=[11, 12, 13], parents=[ANCHOR, ANCHOR, 0], depths=[0, 0, 1])
    mask = tree_attention_mask(tree, past=3, dtype=torch.float32, device="cpu")[0, 0] == 0
    assert mask.tolist() == [[True] * 4 + [False] * 3,
                             [True] * 5 + [False] * 2,
                             [True] * 4 + [False, True, False],
                             [True] * 5 + [False, True]]
    assert tree_positions(tree, 3) == [3, 4, 4, 5]
    prompt, anchor = [1, 504, 3112], 314
    cache = prefilled(tiny_llama, prompt)
    with torch.no_grad():
        logits = tiny_llama(input_ids=torch.tensor([[anchor] + tree.tokens]), position_ids=torch.tensor([tree_positions(tree, 3)]),
                            attention_mask=tree_attention_mask(tree, 3, torch.float32, "cpu"), cache=cache, use_cache=True).logits[0]
    for row, path in enumerate([[], [11], [12], [11, 13]]):
        torch.testing.assert_close(logits[row], plain_logits(tiny_llama, prompt + [anchor] + path), rtol=1e-4, atol=1e-4)


def scripted_setup():
    """A stand-in target that always continues with script[position], and a drafter (its context cache only)."""
    from support.targets import ScriptedTarget, small_vocab_setup

    drafter, _, _ = small_vocab_setup()  # block 4: trees of depth 3
    script = torch.randperm(300, generator=torch.Generator().manual_seed(0)).add(3).tolist()  # no token twice
    target = ScriptedTarget(script, drafter.config.feature_width)
    tap = type("Tap", (), {"features": lambda self: target.features})()
    return drafter, target, tap, script


def rigged_tree_proposer(answer: list[int], prompt_length: int, budget: int, *, right_rank: int, wrong=(5, 6)):
    """A drafter whose first slot ranks the right token `right_rank`-th (0 = its argmax) behind
    decoys and whose later slots rank it first, so the top-1 chain fails at once where a tree
    that reaches the right first token follows the answer down."""

    def propose(cache, anchor):
        produced = cache.length - prompt_length
        rows, ids = [], []
        for slot in range(1, 4):
            right = answer[produced + slot] if produced + slot < len(answer) else 0
            decoys = [w for w in wrong if w != right]
            rank = right_rank if slot == 1 else 0
            ids.append(decoys[:rank] + [right] + decoys[rank:])
            rows.append([-0.1 * r - (0.05 if slot > 1 else 0.0) for r in range(len(ids[-1]))])
        tree = build_draft_tree(rows, ids, budget)
        return Proposal(tree.tokens, tree=tree)

    return propose


def test_a_tree_finds_the_answer_off_the_top1_chain_where_the_chain_does_not():
    drafter, target, tap, script = scripted_setup()
    prompt = [1, 2, 3, 4, 5, 6]
    answer = script[len(prompt) - 1 :]
    plain = host_greedy_decode(target, prompt, max_new_tokens=25, eos_ids=set())
    chain = host_speculative_decode(target, tap, drafter, rigged_tree_proposer(answer, len(prompt), 3, right_rank=1), prompt,
                               max_new_tokens=25, eos_ids=set())  # budget 3 grows the top-1 chain only
    tree = host_speculative_decode(target, tap, drafter, rigged_tree_proposer(answer, len(prompt), 12, right_rank=1), prompt,
                              max_new_tokens=25, eos_ids=set())
    assert chain.tokens == tree.tokens == plain.tokens == answer[:25]
    assert set(chain.steps) == {1}  # every top-1 token is a decoy
    assert set(tree.steps[:-1]) == {4}  # the second-ranked path of 3 slots, plus the bonus
    assert tree.drafted == 12 * len(tree.steps)


def test_an_eos_inside_the_tree_ends_the_answer_and_a_rejected_tree_commits_the_bonus_only():
    drafter, target, tap, script = scripted_setup()
    prompt = [1, 2, 3, 4, 5, 6]
    answer = script[len(prompt) - 1 :]
    eos = {answer[2]}  # the second node of the first accepted path (answer[0] comes from the prefill)
    plain = host_greedy_decode(target, prompt, max_new_tokens=25, eos_ids=eos)
    run = host_speculative_decode(target, tap, drafter, rigged_tree_proposer(answer, len(prompt), 12, right_rank=1), prompt,
                             max_new_tokens=25, eos_ids=eos)
    assert run.tokens == plain.tokens == answer[:3] and run.steps == [4]

    def hopeless(cache, anchor):  # no node is ever the target's token
        tree = build_draft_tree([[0.0, -1.0]] * 3, [[1, 2]] * 3, 6)
        return Proposal(tree.tokens, tree=tree)

    rejected = host_speculative_decode(target, tap, drafter, hopeless, prompt, max_new_tokens=10, eos_ids=set())
    assert rejected.tokens == answer[:10] and set(rejected.steps) == {1}


@pytest.mark.parametrize("budget", [1, 4, 8])
def test_tree_decoding_with_a_real_drafter_equals_plain_greedy(tiny_target, budget):
    model, _, head, drafter, prompt = tiny_target
    plain = greedy_decode(model, prompt, max_new_tokens=30, eos_ids={2})
    run = speculative_decode(model, Speculation(drafter, head, DecodingMode.tree(budget)), prompt, max_new_tokens=30, eos_ids={2})
    assert run.tokens == plain.tokens
    assert run.drafted == budget * len(run.steps)
