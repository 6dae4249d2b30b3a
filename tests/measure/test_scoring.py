"""measure/scoring.py by hand: τ of a block, the DDTree streak of the smallest trees, and what a
DFlash2 summary adds (its selector's gain over each slot's own argmax, and the top-K oracle)."""

import math

import numpy as np
import pytest

from dflash_pipeline.measure.scoring import BlockScores, ddtree_streak, summarize_blocks
from dflash_pipeline.foundation.stats import acceptance_length


def test_tau_counts_leading_correct_slots_and_a_missing_slot_ends_the_run():
    correct = np.array([[0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 1]], dtype=bool)
    assert acceptance_length(correct).tolist() == [1, 3, 4, 2]
    assert acceptance_length(np.zeros((0, 3), dtype=bool)).tolist() == []


def test_a_tree_of_one_node_is_the_first_slots_argmax_and_more_nodes_never_walk_less():
    logprobs = [[math.log(0.6), math.log(0.4)], [math.log(0.9), math.log(0.1)]]  # two depths, two candidates each
    token_ids = [[5, 7], [8, 9]]
    assert ddtree_streak(logprobs, token_ids, [5, 8], 1) == 1
    assert ddtree_streak(logprobs, token_ids, [7, 8], 1) == 0  # the answer is the second candidate
    streaks = [ddtree_streak(logprobs, token_ids, [7, 8], budget) for budget in range(1, 5)]
    assert streaks == sorted(streaks) and streaks[-1] == 2  # budget 4 holds every prefix here: [7] and [7, 8]


def test_a_dflash2_summary_reports_its_selectors_gain_and_the_top_k_oracle():
    sequence = np.array([0, 0, 1, 1])
    walk = np.array([[1, 1], [1, 0], [1, 1], [0, 0]], dtype=bool)  # tau 3, 2, 3, 1
    argmax = np.array([[1, 0], [1, 0], [1, 1], [0, 0]], dtype=bool)  # tau 2, 2, 3, 1
    in_top_k = np.ones_like(walk)  # tau 3 everywhere
    scores = BlockScores(sequence=sequence, anchor=np.zeros(4, int), correct=walk, valid=np.ones_like(walk),
                         architecture="dflash2", extras={"argmax_correct": argmax, "in_top_k": in_top_k})
    summary = summarize_blocks(scores)
    extras = summary.extras  # DFlash2's own figures, from its architecture's summarize_extras
    assert summary.tau.mean == pytest.approx(2.25) and extras["tau_argmax"] == pytest.approx(2.0)
    assert extras["tau_oracle"] == pytest.approx(3.0) and extras["tau_oracle_ci95"] == pytest.approx(0.0)
    assert extras["tau_selector_gain"] == pytest.approx(0.25)  # prompt 0 gains 0.5, prompt 1 gains 0
    assert extras["slot1_topk_recall"] == 1.0 and extras["slot2_topk_recall"] == 1.0


def test_a_plain_summary_has_no_selector_or_category_keys():
    correct = np.array([[1, 0], [0, 0]], dtype=bool)
    summary = summarize_blocks(BlockScores(sequence=np.array([0, 1]), anchor=np.zeros(2, int), correct=correct,
                                           valid=np.ones_like(correct)))
    assert summary.blocks == 2 and summary.prompts == 2 and summary.slot_acceptance[0] == 0.5
    assert summary.extras == {} and summary.categories == {}
