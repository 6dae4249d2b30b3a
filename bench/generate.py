"""Benchmark: batched greedy generation vs one prompt at a time, on the default target.

    python bench/generate.py [--batch 64] [--single-prompts 4] [--max-new-tokens 64]
    python bench/generate.py --dry-run      # the tiny random target, 4 prompts x 4 tokens (tests/bench/test_dry_runs.py)

Needs the `target` stage's output (dvc repro target). Both settings run in this one process on
the same prompts (the first --batch prompts of the default set; batch 1 runs the first
--single-prompts of them), alternately, and the ratio of generated tokens per second is printed.
Generated tokens are counted as produced: rows that stop at EOS leave the batch.
"""

import os
import sys
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `bench.*` from a plain `python bench/...`

from bench.toy import REPO_ROOT, dry_run_options, toy_run  # noqa: E402


def _throughput(model, prompts, *, batch_size, max_new_tokens, eos_ids, pad_id):
    from dflash_pipeline.foundation.devices import timed
    from dflash_pipeline.generate.run import greedy_generate

    def generate_all():
        return sum(len(answer.token_ids)
                   for start in range(0, len(prompts), batch_size)
                   for answer in greedy_generate(model, prompts[start : start + batch_size], max_new_tokens=max_new_tokens,
                                                 eos_ids=eos_ids, pad_id=pad_id))

    return timed(generate_all, next(model.parameters()).device)


@click.command()
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--prompts", "prompts_path", type=click.Path(path_type=Path), default="data/prompts/default.jsonl", show_default=True)
@click.option("--batch", "batch_size", default=64, show_default=True)
@click.option("--single-prompts", default=4, show_default=True, help="Prompts decoded one at a time.")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--rounds", default=1, show_default=True, help="Alternating rounds of (batch 1, batched).")
@dry_run_options
def main(target_json, prompts_path, batch_size, single_prompts, max_new_tokens, rounds, dry_run, work):
    import torch

    from dflash_pipeline.generate.run import render_prompt
    from dflash_pipeline.data.prompts import read_prompts
    from dflash_pipeline.target.load import TargetInfo, load_target

    if dry_run:
        target_json, prompts_path = toy_run(work, upto="target").target_json, REPO_ROOT / "data" / "prompts" / "default.jsonl"
        batch_size, single_prompts, max_new_tokens, rounds = 4, 2, 4, 1
    info = TargetInfo.from_json(target_json)
    model, tokenizer = load_target(info, device="cpu")
    prompt_set = read_prompts(prompts_path, val_fraction=0.1, limit=batch_size)
    prompts = [render_prompt(tokenizer, p, system_prompt=None, enable_thinking=False) for p in prompt_set.prompts]
    eos_ids, pad_id = set(info.eos_token_ids), tokenizer.pad_token_id or 0
    print(f"target {info.architecture} ({info.num_layers} layers), torch threads {torch.get_num_threads()}, "
          f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, max_new_tokens {max_new_tokens}")
    totals = {1: [0, 0.0], batch_size: [0, 0.0]}
    for round_index in range(rounds):
        for size, subset in ((1, prompts[:single_prompts]), (batch_size, prompts)):
            tokens, seconds = _throughput(model, subset, batch_size=size, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
            totals[size][0] += tokens
            totals[size][1] += seconds
            print(f"round {round_index + 1}: batch {size:>4}: {tokens:>6} tokens in {seconds:7.1f} s = {tokens / seconds:7.1f} tokens/s")
    single = totals[1][0] / totals[1][1]
    batched = totals[batch_size][0] / totals[batch_size][1]
    print(f"batch 1: {single:.1f} tokens/s; batch {batch_size}: {batched:.1f} tokens/s; ratio {batched / single:.1f}x")


if __name__ == "__main__":
    main()
