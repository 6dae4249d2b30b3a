"""The periodic held-out τ during training: evaluate's own teacher-forced scorer on the val split,
with the same anchor seed rule and the same 95% interval over prompts."""

import math

from dflash_pipeline.foundation.devices import autocast
from dflash_pipeline.foundation.stats import mean_ci95_over_prompts
from dflash_pipeline.measure.scoring import per_slot_acceptance, score_teacher_forced
from dflash_pipeline.train.state import TrainingRun


def validation_tau(run: TrainingRun) -> dict:
    """Held-out teacher-forced τ with evaluate's own scorer (`scoring.score_teacher_forced`): the
    same anchors seed rule, the same 95% interval over prompts. About `eval_blocks` blocks: an
    equal number of anchors from every val sequence."""
    config = run.config
    per_sequence = max(1, math.ceil(config.eval_blocks / max(1, len(run.val_set))))
    with autocast(run.device, run.bf16):
        scores = score_teacher_forced(run.drafter, run.head, run.val_set, anchors_per_sequence=per_sequence,
                                      tokens_per_batch=config.tokens_per_step, tree_budgets=[], seed=config.seed,
                                      attention=run.attention)
    run.drafter.train()
    tau, ci = mean_ci95_over_prompts(scores.tau, scores.sequence)
    unconditional, _ = per_slot_acceptance(scores)
    return {"tau": tau, "tau_ci95": ci, "blocks": int(scores.tau.shape[0]), "slot_accuracy": unconditional}
