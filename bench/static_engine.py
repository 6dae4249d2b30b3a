"""The static speculative step against the host loop, side by side in one process (issue #28).

    python bench/static_engine.py [--checkpoint data/checkpoints/step_001600] [--num-prompts 8]
                                  [--max-new-tokens 128] [--tree-budget 4] [--rounds 2] [--device cuda]

The chosen drafter (data/eval/best.json) decodes the same val prompts on both engines:
  host     tests/oracles' `host_greedy_decode` / `host_speculative_decode`: transformers' forward
           and DynamicCache, acceptance read back every step (the loops the engine replaced, kept
           as the references it is tested against)
  static   `plain.greedy_decode` / `Speculation.decode`: static KV,
           a step drafted, verified and accepted on the device (`static-kv`)
in three modes: plain greedy, the greedy chain (all B-1 tokens) and the greedy DDTree. Each
(mode, prompt) runs host and static back to back, alternating which goes first, for `--rounds`
rounds. Printed per mode: tokens/s of each engine and their ratio, ms per step, and whether the
two engines' answers (and steps) are identical; then each engine's speculative speedup over its
own plain decoding. `--json` writes the figures.
"""

import json
import os
import sys
import time
from pathlib import Path

import click

from decoding_setup import decoding_options, host_oracles, load_decoding_setup

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


@click.command()
@decoding_options
@click.option("--tree-budget", default=4, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(checkpoint, hidden, generated, target_json, num_prompts, max_new_tokens, device, tree_budget, rounds, json_path):
    import torch

    from dflash_pipeline.decoding.plain import greedy_decode
    from dflash_pipeline.decoding.session import Speculation
    from dflash_pipeline.foundation.devices import machine_description
    from dflash_pipeline.speculation.modes import DecodingMode
    from dflash_pipeline.target.load import LayerTap

    host_oracles()
    from oracles.decoding import host_greedy_decode, host_speculative_decode
    from oracles.drafting import drafter_proposer, tree_proposer

    setup = load_decoding_setup(checkpoint, hidden, generated, target_json, num_prompts, device)
    drafter, model, head = setup.drafter, setup.model, setup.head
    tap = LayerTap(model, list(drafter.config.target_layer_ids))  # the host loop reads the layers through hooks
    prompts, eos_ids, feature_dtype = setup.prompts, setup.eos_ids, setup.val_set.manifest.feature_dtype
    common = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    tree = DecodingMode.tree(tree_budget)
    chain_mode, tree_mode = Speculation(drafter, head), Speculation(drafter, head, tree)
    chain_proposer, tree_proposer = drafter_proposer(drafter, head), tree_proposer(drafter, head, tree_budget)
    spec = dict(feature_dtype=feature_dtype, **common)
    modes = {  # mode -> (host engine, static engine)
        "plain": (lambda ids: host_greedy_decode(model, ids, **common), lambda ids: greedy_decode(model, ids, **common)),
        "chain": (lambda ids: host_speculative_decode(model, tap, drafter, chain_proposer, ids, **spec),
                  lambda ids: chain_mode.decode(model, ids, **spec)),
        tree.name: (lambda ids: host_speculative_decode(model, tap, drafter, tree_proposer, ids, **spec),
                               lambda ids: tree_mode.decode(model, ids, **spec)),
    }

    started = time.perf_counter()
    for host, static in modes.values():  # warm-up: first-call allocations, the static steps' buffers (and graphs)
        host(prompts[0][1][:32])
        static(prompts[0][1][:32])
    figures = {}
    for mode, (host, static) in modes.items():
        totals = {"host": [0, 0.0, 0], "static": [0, 0.0, 0]}  # tokens, seconds, steps
        same_tokens = same_steps = 0
        for round_number in range(rounds):
            for number, (_, ids) in enumerate(prompts):
                runs = {}
                order = (("host", host), ("static", static)) if (number + round_number) % 2 == 0 else (("static", static), ("host", host))
                for name, decode in order:
                    runs[name] = decode(ids)
                for name, run in runs.items():
                    totals[name][0] += len(run.tokens)
                    totals[name][1] += run.seconds
                    totals[name][2] += len(run.steps) if run.steps else len(run.tokens) - 1
                same_tokens += runs["host"].tokens == runs["static"].tokens
                same_steps += runs["host"].steps == runs["static"].steps
        rate = {name: tokens / seconds for name, (tokens, seconds, _) in totals.items()}
        figures[mode] = {
            "host_tokens_per_s": round(rate["host"], 2), "static_tokens_per_s": round(rate["static"], 2),
            "static_over_host": round(rate["static"] / rate["host"], 4),
            "host_ms_per_step": round(1000 * totals["host"][1] / max(1, totals["host"][2]), 3),
            "static_ms_per_step": round(1000 * totals["static"][1] / max(1, totals["static"][2]), 3),
            "identical_answers": f"{same_tokens}/{rounds * len(prompts)}", "identical_steps": f"{same_steps}/{rounds * len(prompts)}",
        }
        print(f"{mode}: {json.dumps(figures[mode])}", flush=True)
    for mode in list(modes)[1:]:
        for engine in ("host", "static"):
            figures[mode][f"{engine}_speedup_over_plain"] = round(figures[mode][f"{engine}_tokens_per_s"] / figures["plain"][f"{engine}_tokens_per_s"], 4)
    result = {"machine": machine_description(), "device": device, "torch_threads": torch.get_num_threads(), "checkpoint": str(setup.checkpoint),
              "block_size": drafter.config.block_size, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "rounds": rounds,
              "seconds": round(time.perf_counter() - started, 1), "modes": figures}
    print(f"\n{setup.checkpoint}: block {drafter.config.block_size}; {len(prompts)} val prompts x {max_new_tokens} tokens x {rounds} rounds; "
          f"{device} ({result['machine']}), torch threads {torch.get_num_threads()}")
    print(f"{'mode':8s} {'host tok/s':>10s} {'static tok/s':>12s} {'static/host':>11s} {'host ms/step':>12s} {'static ms/step':>14s}  identical")
    for mode, row in figures.items():
        print(f"{mode:8s} {row['host_tokens_per_s']:10.1f} {row['static_tokens_per_s']:12.1f} {row['static_over_host']:11.3f} "
              f"{row['host_ms_per_step']:12.2f} {row['static_ms_per_step']:14.2f}  {row['identical_answers']} answers, {row['identical_steps']} steps")
    for mode in list(modes)[1:]:
        print(f"{mode} speedup over plain: host {figures[mode]['host_speedup_over_plain']:.3f}, static {figures[mode]['static_speedup_over_plain']:.3f}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
