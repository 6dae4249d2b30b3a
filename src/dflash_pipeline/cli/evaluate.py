"""`dflash-pipeline evaluate`: score checkpoints and baseline drafters side by side on one target's
captured val shards, without params.yaml (the evaluate stage's run, `evaluate.run.run_evaluate`)."""

from dataclasses import replace
from pathlib import Path

import click

from dflash_pipeline.cli.group import EXISTING_DIR, comma_separated, folder_kind, generated_val, main, target_info
from dflash_pipeline.foundation.config import EvaluateConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.runtime import device_option, one_line_errors

DEFAULTS = EvaluateConfig()


@main.command(short_help="Score checkpoints and baseline drafters side by side.")
@click.argument("drafters", metavar="DRAFTER...", nargs=-1, required=True, type=EXISTING_DIR)
@click.option("--target", "target_path", required=True, type=click.Path(exists=True, path_type=Path),
              help="The target stage's target.json, or a local Hugging Face model folder (fingerprinted on the fly).")
@click.option("--shards", "shards_dir", required=True, type=EXISTING_DIR,
              help="A capture split folder (data/hidden/val), scored teacher-forced; a capture output folder means its val/.")
@click.option("--prompts", "prompts_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="The generate stage's val.parquet (or its folder): prompts for end-to-end decoding and prompt "
                   "categories. Without it, end-to-end decoding is skipped.")
@click.option("--anchors", type=click.IntRange(min=0), default=DEFAULTS.anchors_per_sequence, show_default=True,
              help="Teacher-forced blocks per val sequence (0: every anchor).")
@click.option("--tree-budgets", callback=comma_separated(int, 1, "4,8,16"), default=",".join(map(str, DEFAULTS.tree_budgets)), show_default=True,
              help="DDTree node budgets, comma-separated.")
@click.option("--temperatures", callback=comma_separated(float, 0, "0,1"),
              default=",".join(f"{t:g}" for t in DEFAULTS.temperatures), show_default=True,
              help="End-to-end sampling temperatures (0: greedy, always run), comma-separated.")
@click.option("--e2e-prompts", type=click.IntRange(min=0), default=DEFAULTS.num_prompts, show_default=True,
              help="Val prompts decoded end to end (0 skips it).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=DEFAULTS.max_new_tokens, show_default=True,
              help="Answer length of each end-to-end decode.")
@click.option("--tokens-per-batch", type=click.IntRange(min=1), default=DEFAULTS.tokens_per_batch, show_default=True,
              help="Context tokens per batched teacher-forced forward.")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True,
              help="Seed of the anchor draw (the same anchors for every drafter).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write the evaluate stage's outputs here (eval.json, details.json, comparison.csv, blocks.parquet, "
                   "e2e.json, best.json, plots/).")
@device_option
@one_line_errors
def evaluate(drafters, target_path, shards_dir, prompts_path, anchors, tree_budgets, temperatures, e2e_prompts, max_new_tokens,
             tokens_per_batch, seed, out_dir, device):
    """Score drafters side by side on one target's captured val shards, without params.yaml.

    Each DRAFTER is a training checkpoint folder (step_NNNNNN, from one run) or a folder in the
    DFlash serving format (an export of ours or a published drafter), scored as a baseline. Every
    drafter is checked against the target and the shards first. Prints the comparison table; the
    best checkpoint (highest teacher-forced tau) is starred and decoded end to end with --prompts.

    \b
    Example:
      dflash-pipeline evaluate data/checkpoints/step_000900 ~/drafters/zlab-qwen3-8b \\
          --target data/target/target.json --shards data/hidden/val \\
          --prompts data/generated/val.parquet --e2e-prompts 4 --out /tmp/eval-900
    """
    from dflash_pipeline.evaluate.report import summary_table, write_outputs
    from dflash_pipeline.evaluate.run import run_evaluate

    kinds = {folder: folder_kind(folder) for folder in drafters}
    for folder, kind in kinds.items():
        if kind not in ("checkpoint", "drafter"):
            raise PipelineError(f"{folder}: a shard folder, not a drafter (checkpoint.json or config.json); pass it as --shards")
    checkpoints = list(dict.fromkeys(folder.resolve() for folder, kind in kinds.items() if kind == "checkpoint"))
    baselines = list(dict.fromkeys(folder.resolve() for folder, kind in kinds.items() if kind == "drafter"))
    config = replace(DEFAULTS, baselines=[str(b) for b in baselines], anchors_per_sequence=anchors,
                     tokens_per_batch=tokens_per_batch, tree_budgets=tree_budgets, temperatures=temperatures, num_prompts=e2e_prompts,
                     max_new_tokens=max_new_tokens, seed=seed)
    config.validate("command line")
    capture_output = not (shards_dir / "manifest.json").is_file() and (shards_dir / "val" / "manifest.json").is_file()
    split = shards_dir / "val" if capture_output else shards_dir
    result = run_evaluate(config, target=target_info(target_path), hidden_val_dir=split, generated_val=generated_val(prompts_path),
                          checkpoint_folders=checkpoints, baseline_dirs=baselines, device=device, log=click.echo,
                          source="command line")
    if out_dir is not None:
        write_outputs(result, out_dir=out_dir, metrics_path=out_dir / "eval.json", plots_dir=out_dir / "plots")
        click.echo(f"evaluate: wrote {out_dir}")
    click.echo(summary_table(result.record))

