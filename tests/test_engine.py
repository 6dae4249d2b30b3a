"""decoding/engine.py on the tiny Llama: plain decoding streams and stops where it should, a
verified prefix cuts a proposal (and its q) to k tokens, and `end_to_end` runs every candidate on
every prompt against one plain run, lossless at T = 0."""

import torch

from dflash_pipeline.decoding.engine import (
    Proposal,
    drafter_proposer,
    end_to_end,
    first_difference,
    greedy_decode,
    summarize_end_to_end,
    verified_prefix,
)


def test_first_difference_is_the_first_parting_position_or_the_shorter_length():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1]) == 1


def test_greedy_decoding_streams_every_token_and_stops_at_an_eos_or_the_cap(tiny_target):
    model, _, _, _, prompt = tiny_target
    streamed = []
    run = greedy_decode(model, prompt, max_new_tokens=6, eos_ids=set(), on_tokens=streamed.extend)
    assert len(run.tokens) == 6 and streamed == run.tokens and 0 < run.prefill_seconds <= run.seconds
    stopped = greedy_decode(model, prompt, max_new_tokens=6, eos_ids={run.tokens[2]})
    assert stopped.tokens == run.tokens[:run.tokens.index(run.tokens[2]) + 1]  # the EOS is kept, nothing after it


def test_a_verified_prefix_cuts_the_tokens_and_their_q_rows():
    q = torch.rand(4, 10)
    chain = verified_prefix(lambda cache, anchor: [7, 8, 9, 10], 2)
    sampled = verified_prefix(lambda cache, anchor: Proposal([7, 8, 9, 10], q), 3)
    assert chain(None, 0) == [7, 8]
    cut = sampled(None, 0)
    assert cut.tokens == [7, 8, 9] and torch.equal(cut.q, q[:3])
    assert verified_prefix(lambda cache, anchor: Proposal([7, 8]), 5)(None, 0).q is None


def test_end_to_end_runs_every_candidate_on_every_prompt_losslessly(tiny_target):
    model, tap, head, drafter, prompt = tiny_target
    prompts = [("a", prompt), ("b", prompt[:5])]
    candidates = [("chain", drafter, drafter_proposer(drafter, head)), ("k1", drafter, verified_prefix(drafter_proposer(drafter, head), 1))]
    results = end_to_end(model, tap, candidates, prompts, max_new_tokens=8, eos_ids=set(), feature_dtype="bf16")
    assert [r.prompt_id for r in results] == ["a", "b"] and all(set(r.speculative) == {"chain", "k1"} for r in results)
    for name in ("chain", "k1"):
        summary = summarize_end_to_end(results, name)
        assert summary["lossless_rate"] == 1.0 and summary["e2e_prompts"] == 2 and summary["mismatches"] == []
    assert all(max(r.speculative["k1"].steps) <= 2 for r in results)  # one drafted token and the bonus per step
