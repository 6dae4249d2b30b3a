"""Speculative decoding modes side by side: greedy chains, greedy DDTrees, and sampled chains under both rules.

    python bench/speculative.py [--checkpoint data/checkpoints/step_001600] [--num-prompts 8] [--temperature 1.0]
                                [--tree-budgets 4,8,16] [--device cuda]
    python bench/speculative.py --dry-run      # a toy checkpoint of the tiny random target (tests/bench/test_dry_runs.py)

The chosen drafter (data/eval/best.json) decodes the same val prompts in every mode, each against
plain decoding in the same mode (greedy, or sampling at T with the same seed), alternating which
goes first, in one process:
  chain T=0            greedy;
  chain T, "match"     the drafter's argmax against the target's own sample;
  chain T, "ratio"     speculative sampling with the drafter's q;
  tree k=N, T=0        the DDTree of the N most probable drafted prefixes, verified in one forward;
each chain verifying all B-1 drafted tokens and, when `evaluate` chose fewer (data/metrics/eval.json's
chain.verify_tokens), that k too.
Per mode: tokens per step, the verify forward's cost in decode steps, speedup, and (at T = 0)
whether every answer equals plain greedy decoding. At T > 0 answers are samples: the test of the
distribution is tests/speculation/test_sampling.py.
"""

import os
import sys
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `bench.*` from a plain `python bench/...`

from bench.decoding_setup import decoding_options, load_decoding_setup  # noqa: E402


@click.command()
@decoding_options
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--tree-budgets", default="4,8,16", show_default=True)
def main(checkpoint, hidden, generated, target_json, num_prompts, max_new_tokens, device, temperature, seed, tree_budgets, dry_run, work):
    import numpy as np
    import torch

    from dflash_pipeline.decoding.plain import greedy_decode
    from dflash_pipeline.decoding.session import speculative_decode
    from dflash_pipeline.foundation.files import read_json
    from dflash_pipeline.speculation.modes import DecodingMode
    from dflash_pipeline.speculation.sampling import Sampling

    setup = load_decoding_setup(checkpoint, hidden, generated, target_json, num_prompts, max_new_tokens, device, dry_run=dry_run, work=work)
    checkpoint, session, drafter, model = setup.checkpoint, setup.session, setup.drafter, setup.model
    prompts, eos_ids, feature_dtype = setup.prompts, setup.eos_ids, setup.val_set.manifest.feature_dtype
    max_new_tokens, device, tree_budgets = setup.max_new_tokens, str(setup.model.device), "4" if dry_run else tree_budgets
    metrics = Path("data/metrics/eval.json")  # the committed run's chosen verify length; a dry run has none
    chosen_k = (read_json(metrics, missing="-").get("chain") or {}).get("verify_tokens") if metrics.is_file() and not dry_run else None
    block = drafter.config.block_size

    lengths = [block - 1] + ([chosen_k] if chosen_k and chosen_k != block - 1 else [])
    modes = [(f"chain T=0, k={k}", None, DecodingMode.chain(k)) for k in lengths]
    modes += [(f"tree k={budget}, T=0", None, DecodingMode.tree(budget)) for budget in (int(b) for b in tree_budgets.split(",") if b.strip())]
    modes += [(f"chain T={temperature:g}, {rule}, k={k}", rule, DecodingMode.chain(k)) for rule in ("match", "ratio") for k in lengths]

    greedy_decode(model, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids)  # warm-up
    rows = []
    for label, rule, mode in modes:
        sampling = Sampling(temperature, rule=rule, seed=seed) if rule else None
        plain_tokens = plain_seconds = spec_tokens = spec_seconds = verify_seconds = decode_seconds = 0.0
        steps, identical, per_step = 0, 0, []
        for number, (_, prompt_ids) in enumerate(prompts):
            speculation = session.speculation(mode)
            runs = {}

            def plain():
                runs["plain"] = greedy_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=sampling)

            def speculative():
                runs["spec"] = speculative_decode(model, speculation, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                                  feature_dtype=feature_dtype, sampling=sampling)

            for part in ((plain, speculative) if number % 2 == 0 else (speculative, plain)):
                part()
            plain_run, spec_run = runs["plain"], runs["spec"]
            plain_tokens += len(plain_run.tokens)
            plain_seconds += plain_run.seconds
            decode_seconds += (plain_run.seconds - plain_run.prefill_seconds) / max(1, len(plain_run.tokens) - 1)
            spec_tokens += len(spec_run.tokens)
            spec_seconds += spec_run.seconds
            verify_seconds += spec_run.verify_seconds
            steps += len(spec_run.steps)
            per_step.append(float(np.mean(spec_run.steps)) if spec_run.steps else 1.0)
            identical += spec_run.tokens == plain_run.tokens
        decode_step = decode_seconds / len(prompts)
        rows.append((label, float(np.mean(per_step)), verify_seconds / max(1, steps) / decode_step,
                     (spec_tokens / spec_seconds) / (plain_tokens / plain_seconds),
                     f"{identical}/{len(prompts)}" if rule is None else "sampled"))
        print(f"{label}: done", flush=True)

    print(f"\n{checkpoint}: block {block}; {len(prompts)} val prompts x {max_new_tokens} tokens; {device}, torch threads {torch.get_num_threads()}")
    print(f"{'mode':28s} {'tokens/step':>11s} {'verify cost':>11s} {'speedup':>8s}  same as plain")
    for label, tau, cost, speedup, same in rows:
        print(f"{label:28s} {tau:11.3f} {cost:11.3f} {speedup:8.3f}  {same}")


if __name__ == "__main__":
    main()
