"""Stage `evaluate`: metric definitions by hand, batched == one-block-at-a-time, lossless decoding."""

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from oracles.decoding import host_greedy_decode, host_speculative_decode
from oracles.drafting import DraftCache, Proposal, draft_block, verified_prefix
from oracles.scoring import score_one_block_at_a_time
from support.targets import ScriptedTarget, small_vocab_setup

from dflash_pipeline.decoding.plain import DecodeRun, forward_costs, greedy_decode
from dflash_pipeline.decoding.session import Speculation, speculative_decode
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.loading import check_drafter_contract
from dflash_pipeline.evaluate.run import select_checkpoints, val_prompts
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.measure.end_to_end import EndToEndPrompt, RunKey, summarize_end_to_end
from dflash_pipeline.measure.record import Mismatch
from dflash_pipeline.measure.scoring import (
    BlockScores, _score_logits, comparison_verdict, ddtree_streak, ddtree_streaks, logits_into, paired_difference,
    per_slot_acceptance, score_teacher_forced, summarize_blocks,
)
from dflash_pipeline.foundation.stats import acceptance_length
from dflash_pipeline.speculation.modes import DecodingMode
from dflash_pipeline.measure.verify_plan import choose_verify_tokens
from dflash_pipeline.target.load import TargetHead

LOG = math.log


# ----------------------------------------------------------------------------- definitions


def test_tau_is_one_plus_the_leading_run_of_correct_slots():
    correct = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=bool)
    assert acceptance_length(correct).tolist() == [3, 1, 5, 1]


def test_ddtree_streaks_by_hand_including_a_path_off_the_top1_chain():
    # depth 1: a=0.6, b=0.4; depth 2: c=0.9, d=0.1. Best-first pops: a (.6), a-c (.54), b (.4),
    # b-c (.36), a-d (.06), b-d (.04).
    logprobs = [[LOG(0.6), LOG(0.4)], [LOG(0.9), LOG(0.1)]]
    ids = [[10, 11], [20, 21]]
    a, b, c, d = 10, 11, 20, 21
    assert [ddtree_streak(logprobs, ids, [a, c], k) for k in (1, 2, 3, 6)] == [1, 2, 2, 2]
    # The reference goes through b, the second-best first token: only a tree holding b-c finds it.
    assert [ddtree_streak(logprobs, ids, [b, c], k) for k in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [ddtree_streak(logprobs, ids, [a, d], k) for k in (4, 5)] == [1, 2]
    assert ddtree_streak(logprobs, ids, [b, d], 6) == 2
    assert ddtree_streak(logprobs, ids, [a], 6) == 1  # the reference ends after one token
    assert ddtree_streak(logprobs, ids, [99, c], 6) == 0
    assert ddtree_streak(logprobs, ids, [a, c], 0) == 0


def test_ddtree_streak_grows_with_budget_and_a_full_tree_finds_any_top_k_path():
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        values = torch.log_softmax(torch.randn(3, 3, generator=generator), dim=-1).sort(dim=-1, descending=True)
        logprobs, ids = values.values.tolist(), values.indices.tolist()
        reference = [row[int(torch.randint(0, 3, (1,), generator=generator))] for row in ids]
        streaks = [ddtree_streak(logprobs, ids, reference, budget) for budget in range(1, 40)]
        assert streaks == sorted(streaks)
        assert streaks[-1] == 3  # 3 + 9 + 27 = 39 nodes: the whole tree


def test_ddtree_equal_scores_pop_in_rank_path_order_like_the_reference():
    # The DDTree reference (liranringel/ddtree, build_ddtree_tree) keys its heap by (-score, rank
    # path): of two prefixes with equal scores, the one whose ranks (r1, r2, ...) come first in
    # lexicographic order pops first. depth 1: a, b both 0.5; depth 2: c, d both 0.5; ranks a=0, b=1,
    # c=0, d=1. Pops, with the rank path and the probability:
    #   1: a   (0,)   .5    offers b (1,) .5 and a-c (0,0) .25
    #   2: b   (1,)   .5    offers b-c (1,0) .25
    #   3: a-c (0,0)  .25   offers a-d (0,1) .25, which now ties with b-c (1,0)
    #   4: a-d (0,1)  .25   because (0,1) < (1,0); first-in-first-out would pop b-c, offered earlier
    #   5: b-c (1,0)  .25,  6: b-d (1,1) .25
    logprobs = [[LOG(0.5), LOG(0.5)], [LOG(0.5), LOG(0.5)]]
    ids = [[10, 11], [20, 21]]
    a, b, c, d = 10, 11, 20, 21
    assert [ddtree_streak(logprobs, ids, [a, d], k) for k in (3, 4, 6)] == [1, 2, 2]
    assert [ddtree_streak(logprobs, ids, [b, c], k) for k in (3, 4, 5)] == [1, 1, 2]
    lockstep = ddtree_streaks(np.array([logprobs] * 2), np.array([ids] * 2), np.array([[a, d], [b, c]]), np.array([2, 2]), [3, 4, 5])
    assert {k: v.tolist() for k, v in lockstep.items()} == {3: [1, 1], 4: [2, 1], 5: [2, 2]}


def tree_by_global_order(logprobs, ids, reference, budget: int) -> int:
    """The tie rule without a heap: every prefix of candidates (ranks r1..rj, 1 <= j <= depth) sorted
    by summed log-prob descending, then rank path ascending; the tree of budget k is the first k."""
    depth, width = len(logprobs), len(logprobs[0])
    paths = [p for j in range(1, depth + 1) for p in itertools.product(range(width), repeat=j)]
    paths.sort(key=lambda p: (-sum(logprobs[d][r] for d, r in enumerate(p)), p))
    tree = {tuple(ids[d][r] for d, r in enumerate(p)) for p in paths[:budget]}
    streak = 0
    while streak < len(reference) and tuple(reference[: streak + 1]) in tree:
        streak += 1
    return streak


def test_ddtree_streak_is_the_first_k_prefixes_in_score_then_rank_path_order():
    rng = np.random.default_rng(11)
    for depth, width in [(1, 3), (2, 2), (2, 4), (3, 3), (4, 2)]:
        for _ in range(60):
            logprobs = -np.sort(rng.integers(0, 3, size=(depth, width)), axis=-1) * 0.5  # heavy ties
            ids = np.stack([rng.permutation(10)[:width] for _ in range(depth)])
            reference = ids[np.arange(depth), rng.integers(0, width, depth)].tolist()
            for budget in (1, 2, 3, 5, 8, 13):
                expected = tree_by_global_order(logprobs.tolist(), ids.tolist(), reference, budget)
                assert ddtree_streak(logprobs.tolist(), ids.tolist(), reference, budget) == expected, (logprobs, budget)


def test_tree_candidates_are_ordered_by_logit_then_token_id_even_at_the_cut():
    # torch.topk orders tied logits arbitrarily (differently for different k, and on CPU and CUDA);
    # the rule takes tied tokens lowest id first, also when several tie at the width-th place and
    # only some make the cut. Depth 1: eight tokens tie at the top; depth 2: token 3 is nearly sure.
    # Budget 10 (width 10): depth 1 gives 3, 9, 17, 20, 33, 41, 50, 58 (ranks 0-7) then 0, 1 (logit 0).
    # Pops: the eight tied first tokens (rank paths (0,) .. (7,)), then their children (r, 0) (all
    # tied, a hair below), in rank order: 3-3, then 9-3; tokens 0 and 1 score below every child.
    vocab, top = 64, [3, 9, 17, 20, 33, 41, 50, 58]
    logits = torch.zeros(3, 2, vocab)
    logits[:, 0, top] = 2.0
    logits[:, 1, 3] = 10.0
    labels = torch.tensor([[9, 3], [17, 3], [3, 3]])
    valid = torch.ones(3, 2, dtype=torch.bool)
    expected = {2: [1, 0, 1], 3: [1, 1, 1], 8: [1, 1, 1], 10: [2, 1, 2]}  # 2: {3, 9}; 3: {3, 9, 17}
    correct, streaks = _score_logits(logits.clone(), labels, valid, list(expected))
    assert correct.tolist() == [[False, True], [False, True], [True, True]]  # the argmax: lowest tied id
    assert {k: v.tolist() for k, v in streaks.items()} == expected
    for block in range(3):  # one block: the scalar tree
        _, alone = _score_logits(logits[block : block + 1].clone(), labels[block : block + 1], valid[:1], list(expected))
        assert {k: v.tolist() for k, v in alone.items()} == {k: [v[block]] for k, v in expected.items()}


def test_tied_logits_score_the_same_one_block_at_a_time_and_in_lockstep():
    # bf16-like coarse logits: many ties inside the top k and at its cut
    generator = torch.Generator().manual_seed(4)
    budgets = [1, 2, 4, 7]
    logits = (torch.randn(200, 3, 12, generator=generator) * 1.5).round()
    labels = torch.where(torch.rand(200, 3, generator=generator) < 0.8, logits.argmax(-1), torch.randint(0, 12, (200, 3), generator=generator))
    valid = torch.rand(200, 3, generator=generator) < 0.9
    correct, streaks = _score_logits(logits.clone(), labels, valid, budgets)
    assert np.array_equal(correct, ((logits.argmax(-1) == labels) & valid).numpy())
    for block in range(200):
        _, alone = _score_logits(logits[block : block + 1].clone(), labels[block : block + 1], valid[block : block + 1], budgets)
        assert [alone[k][0] for k in budgets] == [streaks[k][block] for k in budgets], block
    assert streaks[7].max() == 3


@pytest.mark.parametrize("ties", ["none", "coarse", "heavy"])
def test_lockstep_trees_of_many_blocks_equal_the_scalar_tree(ties):
    # The batched path grows every block's tree in lockstep; it must pop the same nodes, in the
    # same order, as the obvious heap, ties included (coarse log-probs make many equal scores).
    rng = np.random.default_rng(["none", "coarse", "heavy"].index(ties) + 5)
    budgets = [1, 2, 3, 5, 8, 20]
    for depth, width in [(1, 1), (1, 4), (3, 1), (3, 3), (4, 6), (6, 2)] + [(7, 4), (5, 8)] * (ties == "heavy"):
        n = 300
        if ties == "coarse":
            logprobs = -rng.integers(0, 3, size=(n, depth, width)).astype(np.float64) * 0.5
        elif ties == "heavy":  # two values per depth: equal scores across branches at every step
            logprobs = -rng.integers(0, 2, size=(n, depth, width)).astype(np.float64) * rng.choice([0.5, 1.0], (n, depth, 1))
        else:
            logprobs = np.log(rng.dirichlet(np.ones(width + 3), size=(n, depth))[..., :width])
        logprobs = -np.sort(-logprobs, axis=-1)
        ids = np.stack([rng.permutation(10)[:width] for _ in range(n * depth)]).reshape(n, depth, width)
        # references: mostly tokens the tree offers, sometimes one it does not (id 10)
        reference = np.where(rng.random((n, depth)) < 0.85, ids[np.arange(n)[:, None], np.arange(depth), rng.integers(0, width, (n, depth))], 10)
        length = rng.integers(0, depth + 1, n)
        lockstep = ddtree_streaks(logprobs, ids, reference, length, budgets)
        for budget in budgets:
            scalar = [ddtree_streak(logprobs[i].tolist(), ids[i].tolist(), reference[i, : length[i]].tolist(), budget) for i in range(n)]
            assert lockstep[budget].tolist() == scalar, (depth, width, budget)
        assert lockstep[20].max() >= min(depth, 2)  # the cases reach past the first token


def _scores_with_tau(per_block_tau: list[list[int]]) -> BlockScores:
    """BlockScores whose blocks have the given tau, prompt by prompt (block size 5)."""
    sequence = np.concatenate([[p] * len(taus) for p, taus in enumerate(per_block_tau)])
    taus = np.concatenate(per_block_tau)
    correct = np.arange(4)[None, :] < (taus - 1)[:, None]  # tau - 1 leading correct slots
    return BlockScores(sequence=sequence, anchor=np.zeros(len(taus), int), correct=correct, valid=np.ones_like(correct))


def test_paired_difference_cancels_the_spread_between_prompts():
    # Prompt means: ours 1.5, 4.5, 1.5, 4.5; theirs 1.0, 4.0, 1.0, 4.5 -> differences .5, .5, .5, 0.
    ours = _scores_with_tau([[1, 2], [4, 5], [2, 1], [4, 5]])
    theirs = _scores_with_tau([[1, 1], [4, 4], [1, 1], [5, 4]])
    mean, half, prompts = paired_difference(ours, theirs)
    assert prompts == 4 and mean == pytest.approx(0.375)
    assert half == pytest.approx(1.96 * 0.25 / 2)  # sd of (.5, .5, .5, 0) is .25
    own_half = summarize_blocks(ours).tau.ci95
    assert own_half > 1.5 and half < 0.25  # each drafter's own interval would never separate them
    assert comparison_verdict("ours", "theirs", mean, half, prompts) == (
        "ours vs theirs: tau difference +0.3750 ± 0.2450 (paired over 4 prompts): ours is better")
    assert paired_difference(theirs, ours)[0] == pytest.approx(-0.375)
    assert comparison_verdict("a", "b", 0.1, 0.2, 4).endswith("not distinguishable at 95%")
    assert comparison_verdict("a", "b", -0.3, 0.2, 4).endswith("a is worse")
    # One shared prompt has no interval: the console says so in the one spelling, never "inf" or "None".
    assert comparison_verdict("a", "b", 0.5, float("inf"), 1) == "a vs b: tau difference +0.5000 ± n/a (paired over 1 prompts): " \
                                                                   "not distinguishable at 95%"


def test_per_slot_acceptance_conditional_and_unconditional():
    correct = np.array([[1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=bool)
    valid = np.ones_like(correct)
    valid[3, 2] = False  # past the answer's end: not counted at slot 3
    correct[3, 2] = False
    scores = BlockScores(sequence=np.array([0, 0, 1, 1]), anchor=np.zeros(4, int), correct=correct, valid=valid)
    unconditional, conditional = per_slot_acceptance(scores)
    assert unconditional == pytest.approx([3 / 4, 3 / 4, 2 / 3])
    # slot 2 is reached by blocks 0, 1, 3 (slot 1 right): 2 of them right; slot 3 by blocks 1, 3 -> only 1 has it.
    assert conditional == pytest.approx([3 / 4, 2 / 3, 0 / 1])


def test_means_and_confidence_intervals_are_over_prompts_and_categories():
    # prompt 0: taus 3, 1 (mean 2); prompt 1: tau 1; prompt 2: taus 4, 4, 4 (mean 4).
    correct = np.array([[1, 1, 0], [0, 0, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=bool)
    scores = BlockScores(sequence=np.array([0, 0, 1, 2, 2, 2]), anchor=np.zeros(6, int), correct=correct,
                         valid=np.ones_like(correct), streaks={8: np.array([2, 0, 0, 3, 3, 1])})
    summary = summarize_blocks(scores, categories=["code", "math", "code"])
    per_prompt = [2.0, 1.0, 4.0]
    mean = sum(per_prompt) / 3
    sd = math.sqrt(sum((t - mean) ** 2 for t in per_prompt) / 2)
    assert summary.tau.mean == round(mean, 4) and summary.tau.ci95 == round(1.96 * sd / math.sqrt(3), 4)
    assert summary.tau_per_block == round((3 + 1 + 1 + 4 + 4 + 4) / 6, 4)
    assert summary.categories["code"].mean == pytest.approx(3.0) and summary.categories["math"].mean == pytest.approx(1.0)
    assert summary.ddtree_streak[8].mean == round((1.0 + 0.0 + 7 / 3) / 3, 4)
    assert summary.blocks == 6 and summary.prompts == 3 and summary.extras == {}  # DFlash: no architecture extras
    # per slot, unconditional (4, 5 and 4 of 6 blocks) and given the earlier slots (slot 2 reached by 4 blocks, all right;
    # slot 3 by the same 4, of which 3 right)
    assert summary.slot_acceptance == [round(4 / 6, 4), round(5 / 6, 4), round(4 / 6, 4)]
    assert summary.slot_acceptance_conditional == [round(4 / 6, 4), 1.0, 0.75]


# ----------------------------------------------------------------------------- batched scoring


@pytest.mark.parametrize("anchors, logits_chunk, blocks_per_forward", [(0, 1024, 64), (5, 1024, 64), (0, 7, 9)])
def test_batched_scores_equal_one_block_at_a_time(anchors, logits_chunk, blocks_per_forward):
    # logits_chunk 7 (2 blocks of 4 slots) with 9 blocks a forward: the head's chunks straddle forwards
    drafter, head, split = small_vocab_setup()
    batched = score_teacher_forced(drafter, head, split, anchors_per_sequence=anchors, tokens_per_batch=70, tree_budgets=[1, 3, 8],
                                   logits_chunk=logits_chunk, blocks_per_forward=blocks_per_forward)
    plain = score_one_block_at_a_time(drafter, head, split, anchors_per_sequence=anchors, tree_budgets=[1, 3, 8])
    for name in ("sequence", "anchor", "correct", "valid"):
        assert np.array_equal(getattr(batched, name), getattr(plain, name)), name
    for budget in (1, 3, 8):
        assert np.array_equal(batched.streaks[budget], plain.streaks[budget])
    assert len(set(batched.tau.tolist())) >= 3 and batched.streaks[8].max() >= 2  # the data exercises the metrics
    assert np.array_equal(batched.streaks[1], np.minimum(batched.tau - 1, 1))  # one node: the top-1 first token
    if anchors == 0:  # every anchor: all positions a with an answer token at a and a + 1
        expected = sum(int(s.loss_mask.sum()) - 1 for s in split.samples)
        assert batched.tau.shape[0] == expected


def test_dflash2_scores_the_selector_walk_batched_as_one_block_at_a_time():
    from support.drafters import randomize

    drafter, head, split = small_vocab_setup(vocab=12, architecture="dflash2", options=dict(conv_kernel_size=2, conv_group_size=8,
                                                                                                  selector_rank=4, selector_top_k=4))
    randomize(drafter, seed=3)  # an untrained selector walks the argmax: make it choose
    batched = score_teacher_forced(drafter, head, split, anchors_per_sequence=0, tokens_per_batch=70, tree_budgets=[4], logits_chunk=7,
                                   blocks_per_forward=9)
    plain = score_one_block_at_a_time(drafter, head, split, anchors_per_sequence=0, tree_budgets=[4])
    for name in ("correct", "valid"):
        assert np.array_equal(getattr(batched, name), getattr(plain, name)), name
    assert batched.architecture == plain.architecture == "dflash2" and set(batched.extras) == set(plain.extras) == {"argmax_correct", "in_top_k"}
    for name in batched.extras:
        assert np.array_equal(batched.extras[name], plain.extras[name]), name
    argmax_correct, in_top_k = batched.extras["argmax_correct"], batched.extras["in_top_k"]
    assert not np.array_equal(batched.correct, argmax_correct)  # the walk is not each slot's argmax
    assert (in_top_k >= batched.correct).all() and (in_top_k >= argmax_correct).all()
    summary = summarize_blocks(batched)
    extras = summary.extras  # DFlash2's own figures, by name
    assert extras["tau_oracle"] >= max(summary.tau.mean, extras["tau_argmax"])
    assert extras["tau_selector_gain"] == pytest.approx(summary.tau.mean - extras["tau_argmax"], abs=1e-3)
    assert 0 < extras["slot1_topk_recall"] < 1 and {"slot2_topk_recall", "slot3_topk_recall"} <= set(extras)


def test_contract_and_checkpoint_selection_errors_name_the_field(tmp_path):
    drafter, _, _ = small_vocab_setup()

    class Target:
        hidden_size, vocab_size, num_layers = 32, 3, 4

    check_drafter_contract(drafter.config, target=Target, layer_ids=[1, 2], source="x/config.json")
    with pytest.raises(PipelineError, match=r"^x/config.json: drafter target_layer_ids is \[1, 2\], but the shards has \[1, 3\]$"):
        check_drafter_contract(drafter.config, target=Target, layer_ids=[1, 3], source="x/config.json")
    with pytest.raises(PipelineError, match="drafter hidden_size is 32, but the target has 64"):
        check_drafter_contract(drafter.config, target=type("T", (), {"hidden_size": 64, "vocab_size": 3, "num_layers": 4}),
                               layer_ids=None, source="x")
    with pytest.raises(PipelineError, match="mask_token_id 9 is outside"):
        check_drafter_contract(replace(drafter.config, mask_token_id=9), target=Target, layer_ids=None, source="x")
    folders = [tmp_path / f"step_{s:06d}" for s in (100, 200, 300)]
    assert select_checkpoints(folders, "final") == folders[-1:]
    assert select_checkpoints(folders, [100, 300]) == [folders[0], folders[2]]
    with pytest.raises(PipelineError, match=r"^my-params.yaml: key 'evaluate.checkpoints' asks for step 250, .*, got \[250\]$"):
        select_checkpoints(folders, [250], source="my-params.yaml")


# ----------------------------------------------------------------------------- end to end


def test_untrained_drafter_decodes_losslessly_with_tau_near_one(tiny_target):
    model, _, head, drafter, prompt = tiny_target
    plain = greedy_decode(model, prompt, max_new_tokens=30, eos_ids={2})
    spec = speculative_decode(model, Speculation(drafter, head), prompt, max_new_tokens=30, eos_ids={2})
    assert len(plain.tokens) == 30 and spec.tokens == plain.tokens
    assert 1.0 <= np.mean(spec.steps) < 1.5 and sum(spec.steps) == 29  # the first token comes from the prefill


@pytest.mark.parametrize("mode", ["chain", "tree", "match", "ratio"])
def test_a_dflash2_drafter_decodes_losslessly_with_its_selector(tiny_target, mode):
    from support.drafters import randomize

    from dflash_pipeline.speculation.sampling import Sampling

    model, _, head, drafter, prompt = tiny_target
    torch.manual_seed(0)
    dflash2 = randomize(DFlashDrafter(replace(drafter.config, architecture="dflash2", options=dict(conv_kernel_size=2, conv_group_size=16,
                                              selector_rank=8, selector_top_k=4))), seed=2)
    if mode in ("chain", "tree"):
        speculation = Speculation(dflash2, head, DecodingMode.tree(6) if mode == "tree" else DecodingMode.chain())
        plain = greedy_decode(model, prompt, max_new_tokens=30, eos_ids={2})
        assert speculative_decode(model, speculation, prompt, max_new_tokens=30, eos_ids={2}).tokens == plain.tokens
        return
    sampling = Sampling(1.0, rule=mode, top_k=3, seed=4)
    run = speculative_decode(model, Speculation(dflash2, head), prompt, max_new_tokens=20, eos_ids={2},
                             sampling=sampling)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + run.tokens])).logits[0, len(prompt) - 1 : -1]
    assert len(run.tokens) == 20 and all(token in logits.topk(3, dim=-1).indices[i].tolist() for i, token in enumerate(run.tokens))


def oracle(reference: list[int], wrong_from: int | None = None, block_size: int = 5):
    """A rigged drafter for the host oracle loop (`oracles.decoding`) that knows the plain greedy
    answer and proposes its next B-1 tokens (optionally wrong from one slot on)."""
    def propose(cache, anchor):
        produced = cache.length - oracle.prompt_length  # answer tokens committed before the anchor
        proposal = reference[produced + 1 : produced + block_size]
        proposal += [0] * (block_size - 1 - len(proposal))
        if wrong_from is not None:
            proposal[wrong_from:] = [7] * (block_size - 1 - wrong_from)
        return Proposal(proposal)

    return propose


def test_a_perfect_drafter_is_accepted_whole_and_a_wrong_slot_stops_acceptance(tiny_target):
    model, tap, head, drafter, prompt = tiny_target
    plain = greedy_decode(model, prompt, max_new_tokens=41, eos_ids={2})
    oracle.prompt_length = len(prompt)
    perfect = host_speculative_decode(model, tap, drafter, oracle(plain.tokens), prompt, max_new_tokens=41, eos_ids={2})
    assert perfect.tokens == plain.tokens
    assert perfect.steps == [5] * 8  # 1 + 8 steps x 5 tokens = 41: every block accepted whole plus the bonus
    two_right = host_speculative_decode(model, tap, drafter, oracle(plain.tokens, wrong_from=2), prompt, max_new_tokens=41, eos_ids={2})
    assert two_right.tokens == plain.tokens and set(two_right.steps[:-1]) == {3}


def test_end_to_end_summary_reports_mismatch_position_and_break_even():
    plain = DecodeRun(tokens=[5, 6, 7, 8, 9], seconds=1.0, prefill_seconds=0.2)  # 4 decode steps of 0.2 s
    same = DecodeRun(tokens=[5, 6, 7, 8, 9], seconds=0.6, prefill_seconds=0.2, steps=[3, 2], verify_seconds=0.3, draft_seconds=0.1)
    differs = DecodeRun(tokens=[5, 6, 1, 8, 9], seconds=0.6, prefill_seconds=0.2, steps=[2, 3], verify_seconds=0.3, draft_seconds=0.1)
    results = [EndToEndPrompt("p-ok", plain, {RunKey("d"): same}), EndToEndPrompt("p-bad", plain, {RunKey("d"): differs})]
    summary = summarize_end_to_end(results, RunKey("d"))
    assert summary.lossless_rate == 0.5 and summary.mismatches == [Mismatch(prompt_id="p-bad", position=2, near_tie=False)]
    assert summary.tau.mean == pytest.approx(2.5) and summary.speedup == pytest.approx(1.0 / 0.6, rel=1e-3)
    # a speculative step costs (0.3 + 0.1) / 2 = 0.2 s, a plain decode step 0.2 s: break-even at tau 1
    assert summary.break_even_tau == pytest.approx(1.0) and summary.verify_cost_steps == pytest.approx(0.75)
    # the same parting at a near-tie of the target is flagged as such, not found in a string
    tie = summarize_end_to_end([results[0], replace(results[1], near_ties={RunKey("d"): True})], RunKey("d"))
    assert tie.mismatches == [Mismatch(prompt_id="p-bad", position=2, near_tie=True)] and tie.near_tie_mismatches == 1


def test_end_to_end_prompts_are_taken_round_robin_over_categories(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt_id": f"c{i}", "category": "coding", "prompt_ids": [i]} for i in range(4)]
    rows += [{"prompt_id": "m0", "category": "math", "prompt_ids": [10]}, {"prompt_id": "t0", "category": "chat", "prompt_ids": [20]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "val.parquet")
    assert [pid for pid, _ in val_prompts(tmp_path / "val.parquet", 5)] == ["c0", "m0", "t0", "c1", "c2"]
    assert len(val_prompts(tmp_path / "val.parquet", 50)) == 6


def test_speculative_decoding_stops_at_an_eos_accepted_inside_a_block():
    drafter, _, _ = small_vocab_setup()  # block 4; only its context cache is used here
    script = torch.randperm(300, generator=torch.Generator().manual_seed(0)).add(3).tolist()  # no token twice
    target = ScriptedTarget(script, drafter.config.feature_width)
    tap = type("Tap", (), {"features": lambda self: target.features})()
    prompt = [1, 2, 3, 4, 5, 6]
    answer = script[len(prompt) - 1 :]
    eos = {answer[6]}  # block 1 commits answer tokens 1-4, block 2 tokens 5-8: the EOS is accepted mid-block
    plain = host_greedy_decode(target, prompt, max_new_tokens=30, eos_ids=eos)
    assert plain.tokens == answer[:7]
    oracle.prompt_length = len(prompt)
    spec = host_speculative_decode(target, tap, drafter, oracle(answer, block_size=4), prompt, max_new_tokens=30, eos_ids=eos)
    assert spec.tokens == plain.tokens and spec.steps == [4, 4]
    capped = host_speculative_decode(target, tap, drafter, oracle(answer, block_size=4), prompt, max_new_tokens=3, eos_ids=set())
    assert capped.tokens == answer[:3]


def test_logits_written_into_a_reused_buffer_equal_the_heads_own():
    head = TargetHead(torch.randn(50, 8), torch.randn(50, 8))
    buffer = torch.empty(4 * 3 * 50)
    hidden = torch.randn(4, 3, 8)
    first = logits_into(head.lm_head_weight, hidden, buffer)
    assert first.shape == (4, 3, 50) and first.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(first, head.logits(hidden), rtol=0, atol=0)
    fewer = logits_into(head.lm_head_weight, hidden[:1, 1:], buffer)  # a strided slice, fewer rows: the same storage
    torch.testing.assert_close(fewer, head.logits(hidden[:1, 1:]), rtol=0, atol=0)


def test_a_sliding_window_drafter_drafts_the_same_batched_as_at_decoding():
    # Decoding (draft_block) hides context keys more than `sliding_window` before the anchor; the
    # batched forward of training and scoring gets its mask from blocks.build_batch, which must
    # apply the same window.
    from dflash_pipeline.data.blocks import build_batch, scoring_anchor_seed
    drafter, head, split = small_vocab_setup()
    windowed = DFlashDrafter(replace(drafter.config, sliding_window=3)).eval()
    windowed.load_state_dict(drafter.state_dict())
    samples = split.samples[:3]

    def batched_logits(model):
        batch = build_batch(samples, anchors_per_sequence=6, block_size=4, mask_token_id=2,
                            anchor_seeds=[scoring_anchor_seed(0, i) for i in range(3)], sliding_window=model.config.sliding_window)
        hidden = model.forward_blocks(batch.features, batch.context_positions, head.embed(batch.block_ids), batch.block_positions,
                                      batch.mask)
        return head.logits(hidden.view(-1, 4, hidden.shape[-1])[:, 1:]), batch

    with torch.no_grad():
        ours, batch = batched_logits(windowed)
        at_decoding = []
        for block, (number, anchor) in enumerate(zip(batch.block_sequence.tolist(), batch.anchors.tolist())):
            cache = DraftCache(windowed)
            cache.extend(samples[number].features[:anchor].float())
            at_decoding.append(draft_block(windowed, head, cache, int(samples[number].input_ids[anchor])))
        torch.testing.assert_close(ours, torch.stack(at_decoding), rtol=1e-5, atol=1e-5)
        unwindowed, _ = batched_logits(drafter)
    assert (ours - unwindowed).abs().max() > 1e-3  # the window matters on this data


# ----------------------------------------------------------------------------- a draft vocabulary

def test_a_draft_vocabulary_drafts_and_scores_in_its_own_columns():
    # A drafter trained with `train_vocab: data` drafts over those tokens only: its logits are the
    # full head's columns of them, labels outside can never be hit, and both scorers agree.
    drafter, head, split = small_vocab_setup(vocab=6)
    full = score_teacher_forced(drafter, head, split, anchors_per_sequence=0, tokens_per_batch=70, tree_budgets=[1, 3])
    drafter.set_draft_vocab(torch.tensor([3, 0, 2, 0]))  # deduplicated and sorted; tokens 1 and 4 are left out
    assert drafter.draft_vocab.tolist() == [0, 2, 3]
    assert drafter.vocab_index(torch.tensor([0, 1, 2, 3, 4])).tolist() == [0, -1, 1, 2, -1]
    assert drafter.vocab_tokens(torch.tensor([2, 0, 1])).tolist() == [3, 0, 2]
    cache = DraftCache(drafter)
    cache.extend(split.samples[0].features[:9].float())
    restricted = draft_block(drafter, head, cache, 3)
    drafter_full = DFlashDrafter(drafter.config).eval()
    drafter_full.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "draft_vocab"})
    cache_full = DraftCache(drafter_full)
    cache_full.extend(split.samples[0].features[:9].float())
    # The same numbers up to the matmul's rounding (BLAS blocks a 3-row and a 6-row head differently).
    torch.testing.assert_close(restricted, draft_block(drafter_full, head, cache_full, 3)[:, [0, 2, 3]], rtol=1e-6, atol=1e-5)

    batched = score_teacher_forced(drafter, head, split, anchors_per_sequence=0, tokens_per_batch=70, tree_budgets=[1, 3])
    plain = score_one_block_at_a_time(drafter, head, split, anchors_per_sequence=0, tree_budgets=[1, 3])
    for name in ("sequence", "anchor", "correct", "valid"):
        assert np.array_equal(getattr(batched, name), getattr(plain, name)), name
    for budget in (1, 3):
        assert np.array_equal(batched.streaks[budget], plain.streaks[budget])
    first_labels = np.array([int(split.samples[s].input_ids[a + 1]) for s, a in zip(batched.sequence, batched.anchor)])
    assert not batched.correct[np.isin(first_labels, [1, 4]), 0].any()  # absent from the draft vocabulary: never hit
    assert (first_labels == 1).any() and full.correct.shape == batched.correct.shape  # the data exercises an absent label


def test_speculative_decoding_with_a_draft_vocabulary_stays_lossless(tiny_target, monkeypatch):
    model, _, head, drafter, prompt = tiny_target
    plain = greedy_decode(model, prompt, max_new_tokens=30, eos_ids={2})
    restricted = DFlashDrafter(drafter.config).eval()
    restricted.load_state_dict(drafter.state_dict())
    vocabulary = sorted(set(plain.tokens[::2]) | {5, 77, 4000})
    restricted.set_draft_vocab(torch.tensor(vocabulary))
    proposed = []
    member = type(restricted.architecture)
    draft_chain = member.draft_chain

    def recording(self, *args, **kwargs):  # the engine's drafting hook, its chains seen on the way (eager on a CPU)
        tokens, q = draft_chain(self, *args, **kwargs)
        proposed.extend(tokens.tolist())
        return tokens, q

    monkeypatch.setattr(member, "draft_chain", recording)
    spec = speculative_decode(model, Speculation(restricted, head), prompt, max_new_tokens=30, eos_ids={2})
    assert spec.tokens == plain.tokens and proposed and set(proposed) <= set(vocabulary)


def test_the_verify_length_maximises_expected_tokens_per_unit_of_cost():
    # slot acceptances 0.4, 0.5, 0.5: expected tokens 1.4, 1.6, 1.7 for k = 1, 2, 3
    costs = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.5}
    tokens, rates = choose_verify_tokens([0.4, 0.5, 0.5], costs, draft_steps=0.1)
    assert rates == pytest.approx([1.4 / 1.2, 1.6 / 1.3, 1.7 / 1.6])
    assert tokens == 2
    # a free verify forward makes the longest block best; an unreached slot adds nothing
    assert choose_verify_tokens([0.4, 0.5, 0.5], {1: 1, 2: 1, 3: 1, 4: 1}, 0.0)[0] == 3
    assert choose_verify_tokens([0.4, float("nan"), 0.5], {1: 1, 2: 1, 3: 1, 4: 1}, 0.0)[1][1:] == [1.4, 1.4]


def test_verifying_a_prefix_of_the_draft_stays_lossless(tiny_target):
    model, tap, head, drafter, prompt = tiny_target
    plain = greedy_decode(model, prompt, max_new_tokens=30, eos_ids={2})
    oracle.prompt_length = len(prompt)
    for tokens in (1, 2):
        spec = host_speculative_decode(model, tap, drafter, verified_prefix(oracle(plain.tokens), tokens), prompt, max_new_tokens=30,
                                  eos_ids={2})
        assert spec.tokens == plain.tokens
        assert set(spec.steps[:-1]) == {tokens + 1}  # every step commits the verified prefix plus the bonus
    costs = forward_costs(model, prompt, [1, 2, 5], repeats=1)
    assert set(costs) == {1, 2, 5} and all(seconds > 0 for seconds in costs.values())


@pytest.mark.parametrize("rule", ["match", "ratio"])
def test_sampled_speculative_decoding_commits_only_tokens_the_target_could_sample(tiny_target, rule):
    from dflash_pipeline.speculation.sampling import Sampling

    model, _, head, drafter, prompt = tiny_target
    sampling = Sampling(1.0, rule=rule, top_k=3, seed=5)
    streamed = []
    run = speculative_decode(model, Speculation(drafter, head), prompt, max_new_tokens=30, eos_ids={2}, sampling=sampling,
                             on_tokens=streamed.extend)
    again = speculative_decode(model, Speculation(drafter, head), prompt, max_new_tokens=30, eos_ids={2}, sampling=sampling)
    assert run.tokens == again.tokens and streamed == run.tokens and len(run.tokens) == 30
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + run.tokens])).logits[0, len(prompt) - 1 : -1]
    allowed = logits.topk(3, dim=-1).indices
    assert all(token in allowed[i].tolist() for i, token in enumerate(run.tokens))  # top-k = 3: nothing else has mass
    assert len(set(run.tokens)) > 1  # it sampled, not argmax every time
    plain = greedy_decode(model, prompt, max_new_tokens=30, eos_ids={2}, sampling=sampling)  # the reference sampler, same rule
    with torch.no_grad():
        plain_logits = model(input_ids=torch.tensor([prompt + plain.tokens])).logits[0, len(prompt) - 1 : -1]
    assert all(token in plain_logits.topk(3, dim=-1).indices[i].tolist() for i, token in enumerate(plain.tokens))


# ----------------------------------------------------------------------------- a target with sliding-window layers


def test_a_sliding_window_target_decodes_trees_end_to_end_losslessly(tiny_sliding_dir, tmp_path):
    """transformers' sliding-window cache drops old entries, and tree verification moves the
    accepted path's entries inside the cache: evaluate used to decode chains only on such a target.
    The static engine keeps every key with its position, so evaluate decodes the trees end to end,
    lossless, and `decode --tree-budget` answers as plain decoding does."""
    from click.testing import CliRunner
    from support.helpers import write_generated

    from dflash_pipeline.capture.run import run_capture
    from dflash_pipeline.cli import main
    from dflash_pipeline.evaluate.run import run_evaluate
    from dflash_pipeline.foundation.config import (
        CaptureConfig,
        EvaluateConfig,
        TargetConfig,
        TrainConfig,
    )
    from dflash_pipeline.target.load import TargetInfo, prepare_target
    from dflash_pipeline.train.run import run_train

    info = prepare_target(TargetConfig(model=str(tiny_sliding_dir)), out_dir=tmp_path / "target")
    assert info["sliding_window"] == 512
    target = TargetInfo.from_json(tmp_path / "target" / "target.json")
    generated = write_generated(tmp_path / "generated", {"train": 8, "val": 2}, prompt_len=(6, 12), answer_len=(10, 20))
    run_capture(CaptureConfig(layer_ids=[1, 3]), target=target, generated_dir=generated, out_dir=tmp_path / "hidden", device="cpu")
    run_train(TrainConfig(max_steps=2, eval_every=2, save_every=2, eval_blocks=8, tokens_per_step=200, anchors_per_sequence=4,
                          train_vocab="full"),
              target=target, train_dir=tmp_path / "hidden" / "train", val_dir=tmp_path / "hidden" / "val",
              out_dir=tmp_path / "checkpoints", device="cpu", log=lambda *_: None)
    logged = []
    config = EvaluateConfig(checkpoints="final", anchors_per_sequence=4, tree_budgets=[2, 4], num_prompts=1, max_new_tokens=4,
                            temperatures=[0.0])
    result = run_evaluate(config, target=target, hidden_val_dir=tmp_path / "hidden" / "val", generated_val=generated / "val.parquet",
                          checkpoints_dir=tmp_path / "checkpoints", device="cpu", log=logged.append)
    chosen = result.record.chosen_record
    assert set(chosen.teacher_forced.ddtree_streak) == {2, 4}
    assert set(chosen.decoding.trees) == {2, 4} and chosen.decoding.chain.lossless_rate == 1.0
    assert all(tree.lossless_rate == 1.0 for tree in chosen.decoding.trees.values())
    assert not any("sliding" in why for why in chosen.decoding.best.refused.values())

    common = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "checkpoints" / "step_000002"), "--max-new-tokens", "8"]
    tree = CliRunner().invoke(main, ["decode", "Hi", *common, "--tree-budget", "4", "--compare"])
    assert tree.exit_code == 0 and "identical answers" in tree.output, tree.output


def test_the_prefill_is_timed_apart_and_the_decode_figures_leave_it_out_on_both_sides(tiny_target, monkeypatch):
    """Issue #37 item 3: a prompt's prefill (made 100 s slow on a fake clock, plain and speculative
    alike) shows in `prefill_seconds` and the record's prefill means, never in `decode_seconds`,
    the decode tokens/s or `decode_speedup`; the end-to-end `speedup` keeps it, as before."""
    import types

    import dflash_pipeline.decoding.loop as loop
    import dflash_pipeline.decoding.static_speculation as static

    clock = {"now": 0.0}

    def perf_counter():  # every reading moves the fake clock by 1 ms: the decode takes some time
        clock["now"] += 0.001
        return clock["now"]

    def slow(prefill):
        def prefill_slowly(self, *args, **kwargs):
            clock["now"] += 100.0
            return prefill(self, *args, **kwargs)
        return prefill_slowly

    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(loop.PlainStep, "prefill", slow(loop.PlainStep.prefill))
    monkeypatch.setattr(static.SpeculativeStep, "prefill", slow(static.SpeculativeStep.prefill))
    model, tap, head, drafter, prompt = tiny_target
    plain = greedy_decode(model, prompt, max_new_tokens=12, eos_ids={-5})
    spec = speculative_decode(model, Speculation(drafter, head), prompt, max_new_tokens=12, eos_ids={-5})
    for run in (plain, spec):
        assert 100.0 < run.prefill_seconds < 100.01 and 0 < run.decode_seconds < 1.0
        assert run.seconds == pytest.approx(run.prefill_seconds + run.decode_seconds)
    summary = summarize_end_to_end([EndToEndPrompt("p", plain, {RunKey("d"): spec})], RunKey("d"))
    assert summary.plain_decode_tokens_per_s == pytest.approx((len(plain.tokens) - 1) / plain.decode_seconds, rel=1e-3)
    assert summary.spec_decode_tokens_per_s == pytest.approx((len(spec.tokens) - 1) / spec.decode_seconds, rel=1e-3)
    assert summary.decode_speedup == pytest.approx(summary.spec_decode_tokens_per_s / summary.plain_decode_tokens_per_s, rel=1e-3)
    assert summary.plain_prefill_ms == pytest.approx(1000 * plain.prefill_seconds, rel=1e-6)
    assert summary.spec_prefill_ms == pytest.approx(1000 * spec.prefill_seconds, rel=1e-6)
    assert summary.speedup == pytest.approx(len(spec.tokens) / spec.seconds / (len(plain.tokens) / plain.seconds), rel=1e-3)
