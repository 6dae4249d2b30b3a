"""train/validation.py: the periodic held-out τ is evaluate's scorer, with its interval over prompts."""

import math

import torch
from support.stage_commands import TINY_TRAIN, train_tiny_run

from dflash_pipeline.drafters.checkpoints import load_checkpoint
from dflash_pipeline.target.load import load_target_head


def test_periodic_tau_is_evaluates_scorer_with_its_interval_over_prompts(tiny_run, tmp_path):
    # One teacher-forced scorer: train's tau (and CI) is what `evaluate` reports for the same
    # checkpoint, anchors and seed, with the 95% interval over prompts, not over blocks.
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.measure.scoring import score_teacher_forced, summarize_blocks

    target, root = tiny_run
    result = train_tiny_run(tiny_run, tmp_path / "ck")
    drafter, _ = load_checkpoint(tmp_path / "ck" / "step_000006")
    val = open_split(root / "hidden" / "val")
    scores = score_teacher_forced(drafter, load_target_head(target, device="cpu", dtype=torch.float32), val,
                                  anchors_per_sequence=math.ceil(TINY_TRAIN.eval_blocks / len(val)), tokens_per_batch=4096,
                                  tree_budgets=[], seed=TINY_TRAIN.seed)
    summary = summarize_blocks(scores)
    assert (result.held_out.tau.mean, result.held_out.tau.ci95) == (summary.tau.mean, summary.tau.ci95)
    assert result.held_out.slot_accuracy == summary.slot_acceptance
    assert summary.prompts == len(val) and summary.blocks > len(val)
