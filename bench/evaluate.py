"""Benchmark: batched teacher-forced evaluation vs a plain loop that drafts one block per forward.

    python bench/evaluate.py [--checkpoint data/checkpoints/step_001600] [--sequences 0]
    python bench/evaluate.py --dry-run      # a toy checkpoint of the tiny random target (tests/bench/test_dry_runs.py)

Needs the `capture` and `train` outputs. Three paths score the same blocks (same anchors, same
DDTree budgets) of the val shards in this one process and must give identical numbers: a loop
drafting one block per forward from a freshly built context (what a script written block by
block does), the same loop reusing the drafter's context cache, and the batched evaluation. The
benchmark checks that, then prints their times and ratios for:

- the story's setting: 3 prompts x 15 blocks;
- the default evaluation of one checkpoint: every val prompt (or `--sequences` of them) x
  `evaluate.anchors_per_sequence` blocks.

Then it splits the batched path's time into drafter forwards, the vocabulary head's matmul,
and the top-k / log-sum-exp / tree scoring of its logits. The one-block loop is the reference the
scorer is tested against (tests/oracles/scoring.py).
"""

import os
import sys
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]  # the checkout for `bench.*`, tests/ for `oracles`

from bench.toy import dry_run_options, toy_run  # noqa: E402


def time_split(drafter, head, dataset, chosen, config, budgets) -> str:
    """Seconds in the drafter forwards, the head's matmul and the logits' scoring (one batched run)."""
    from dflash_pipeline.measure import scoring
    from dflash_pipeline.foundation.devices import timed
    from dflash_pipeline.drafters.core import DFlashDrafter

    spent = {"drafter forwards": 0.0, "head matmul": 0.0, "scoring (top-k, log-sum-exp, trees)": 0.0}
    originals = [(DFlashDrafter, "forward_blocks"), (scoring, "logits_into"), (scoring, "_score_logits")]

    device = head.lm_head_weight.device

    def clocked(function, key):
        def wrapper(*args, **kwargs):
            result, seconds = timed(lambda: function(*args, **kwargs), device)
            spent[key] += seconds
            return result
        return wrapper

    saved = [getattr(owner, name) for owner, name in originals]
    for (owner, name), function, key in zip(originals, saved, spent):
        setattr(owner, name, clocked(function, key))
    try:
        _, total = timed(lambda: scoring.score_teacher_forced(drafter, head, dataset, anchors_per_sequence=config.anchors_per_sequence,
                                                                 tokens_per_batch=config.tokens_per_batch, tree_budgets=budgets,
                                                                 seed=config.seed, sequences=chosen), device)
    finally:
        for (owner, name), function in zip(originals, saved):
            setattr(owner, name, function)
    rest = total - sum(spent.values())
    return f"{total:.2f} s = " + ", ".join(f"{key} {value:.2f} s" for key, value in [*spent.items(), ("the rest", rest)])


@click.command()
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None, help="Default: the last checkpoint in data/checkpoints.")
@click.option("--hidden", type=click.Path(path_type=Path), default="data/hidden/val", show_default=True)
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml", show_default=True)
@click.option("--sequences", default=0, show_default=True, help="Val prompts in the larger comparison (0 = all of them).")
@click.option("--device", default=None, help="Default: cuda when present, else cpu. The head stays fp32 (TF32 off) so the paths can agree exactly.")
@dry_run_options
def main(checkpoint, hidden, target_json, params_path, sequences, device, dry_run, work):
    import numpy as np
    import torch

    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.foundation.devices import timed
    from dflash_pipeline.measure.scoring import score_teacher_forced
    from oracles.scoring import score_one_block_at_a_time
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.target.load import TargetInfo
    from dflash_pipeline.drafters.checkpoints import list_checkpoints, load_checkpoint
    from dflash_pipeline.target.load import load_target_head

    if dry_run:
        toy = toy_run(work)
        checkpoint, hidden, target_json, params_path, sequences, device = (toy.last_checkpoint, toy.hidden / "val", toy.target_json,
                                                                           REPO_ROOT / "params.yaml", 2, "cpu")
    config = load_params(params_path).evaluate
    target = TargetInfo.from_json(target_json)
    checkpoint = checkpoint or list_checkpoints(Path("data/checkpoints"))[-1]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    drafter, _ = load_checkpoint(checkpoint)
    drafter = drafter.to(device)
    head = load_target_head(target, device=device, dtype=torch.float32)
    dataset = open_split(hidden, expected_fingerprint=target.fingerprint)
    budgets = list(config.tree_budgets)
    print(f"drafter {checkpoint} ({drafter.config.num_layers} layer(s), block {drafter.config.block_size}); "
          f"{len(dataset)} val prompts; {device}, torch threads {torch.get_num_threads()}")

    def compare(label, chosen, anchors):
        kwargs = dict(anchors_per_sequence=anchors, tree_budgets=budgets, seed=config.seed, sequences=chosen)
        score_teacher_forced(drafter, head, dataset, tokens_per_batch=config.tokens_per_batch, **{**kwargs, "sequences": chosen[:1]})  # warm-up
        batched, batched_s = timed(lambda: score_teacher_forced(drafter, head, dataset, tokens_per_batch=config.tokens_per_batch, **kwargs), device)
        fresh, fresh_s = timed(lambda: score_one_block_at_a_time(drafter, head, dataset, reuse_context=False, **kwargs), device)
        cached, cached_s = timed(lambda: score_one_block_at_a_time(drafter, head, dataset, **kwargs), device)
        same = True
        for plain in (fresh, cached):
            same &= all(np.array_equal(getattr(batched, n), getattr(plain, n)) for n in ("sequence", "anchor", "correct", "valid"))
            same &= all(np.array_equal(batched.streaks[b], plain.streaks[b]) for b in budgets)
        blocks = batched.tau.shape[0]
        print(f"{label}: {blocks} blocks, block-mean tau {batched.tau.mean():.3f}; identical numbers on all three paths: {same}\n"
              f"  one block per forward, context rebuilt per block: {fresh_s:.2f} s ({blocks / fresh_s:.0f} blocks/s)\n"
              f"  one block per forward, context cache reused:      {cached_s:.2f} s ({blocks / cached_s:.0f} blocks/s)\n"
              f"  batched (all blocks of a group in one forward):    {batched_s:.2f} s ({blocks / batched_s:.0f} blocks/s): "
              f"{fresh_s / batched_s:.1f}x and {cached_s / batched_s:.1f}x faster")
        return same

    ok = compare("story setting (3 prompts x 15 blocks)", [0, 1, 2], 15)
    chosen = list(range(sequences or len(dataset)))
    ok &= compare(f"{'default evaluation' if not sequences else 'subset'}: {len(chosen)} prompts x {config.anchors_per_sequence} blocks",
                  chosen, config.anchors_per_sequence)
    print("where the batched path's time goes:", time_split(drafter, head, dataset, chosen, config, budgets))
    if not ok:
        raise SystemExit("batched and one-block-at-a-time numbers differ")


if __name__ == "__main__":
    main()
