"""How many drafted tokens to verify per step: every length side by side, and the one evaluate picks.

    python bench/verify_length.py [--checkpoint data/checkpoints/step_001600] [--num-prompts 8]
    python bench/verify_length.py --dry-run      # a toy checkpoint of the tiny random target (tests/bench/test_dry_runs.py)

One drafter (default: the chosen checkpoint of `data/eval/best.json`) decodes the same val
prompts verifying k = 1 .. B-1 drafted tokens per step, all in one process against one plain
greedy run per prompt (`end_to_end.end_to_end`, alternating which goes first). Prints, per k, the
tokens per step, the speedup over plain decoding and the lossless rate, then the target forward
costs and the k that `verify_plan.choose_verify_tokens` predicts from them and the teacher-forced slot
acceptance, as `evaluate` does.
"""

import os
import sys
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the checkout: `bench.*` from a plain `python bench/...`

from bench.decoding_setup import decoding_options, load_decoding_setup  # noqa: E402


@click.command()
@decoding_options
def main(checkpoint, hidden, generated, target_json, num_prompts, max_new_tokens, device, dry_run, work):
    import torch

    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.measure.verify_plan import measure_forward_costs, plan_verify_tokens
    from dflash_pipeline.measure.end_to_end import RunKey, end_to_end, summarize_end_to_end
    from dflash_pipeline.speculation.modes import DecodingMode
    from dflash_pipeline.measure.scoring import per_slot_acceptance, score_teacher_forced

    setup = load_decoding_setup(checkpoint, hidden, generated, target_json, num_prompts, max_new_tokens, device, dry_run=dry_run, work=work)
    checkpoint, drafter, head, model, val_set = setup.checkpoint, setup.drafter, setup.head, setup.model, setup.val_set
    prompts, eos_ids, max_new_tokens = setup.prompts, setup.eos_ids, setup.max_new_tokens
    config = load_params(REPO_ROOT / "params.yaml").evaluate
    scores = score_teacher_forced(drafter, head, val_set, anchors_per_sequence=config.anchors_per_sequence,
                                  tokens_per_batch=config.tokens_per_batch, tree_budgets=[], seed=config.seed)
    _, conditional = per_slot_acceptance(scores)
    block = drafter.config.block_size

    costs = measure_forward_costs(model, prompts[0][1], block)
    plan = plan_verify_tokens(model, setup.session.speculation(), prompts[0][1], conditional, eos_ids=eos_ids,
                              feature_dtype=val_set.manifest.feature_dtype, costs=costs)  # exactly as evaluate chooses
    chosen, rates, draft_steps = plan.tokens, plan.expected_rates, plan.draft_cost_steps

    candidates = [(f"k={k}", setup.session.speculation(DecodingMode.chain(k))) for k in range(1, block)]
    results = end_to_end(model, candidates, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                         feature_dtype=val_set.manifest.feature_dtype, progress=True)
    print(f"{checkpoint}: block {block}, teacher-forced conditional acceptance {[round(a, 3) for a in conditional]}; "
          f"{len(prompts)} val prompts x {max_new_tokens} tokens; torch threads {torch.get_num_threads()}")
    print("target forward of n tokens, in decode steps: " + ", ".join(f"n={n}: {c:.3f}" for n, c in sorted(costs.items()))
          + f"; drafting {draft_steps:.3f}")
    print(f"{'verify k':>8} {'tokens/step':>12} {'speedup':>8} {'break-even':>10} {'predicted rate':>14} lossless")
    for k, (name, speculation) in enumerate(candidates, start=1):
        summary = summarize_end_to_end(results, RunKey(name, speculation.mode))
        print(f"{k:8d} {summary.tau.mean:12.3f} {summary.speedup:8.3f} {summary.break_even_tau:10.3f} {rates[k - 1]:14.3f} "
              f"{summary.lossless_rate}")
    print(f"evaluate's rule picks k = {chosen}")


if __name__ == "__main__":
    main()
