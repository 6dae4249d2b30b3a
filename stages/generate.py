"""DVC stage `generate`: the target regenerates greedy answers to the prompt set.

    python stages/generate.py --params params.yaml --prompts data/prompts/default.jsonl \
        --target data/target/target.json --out data/generated --metrics data/metrics/generate.json
    python stages/launch.py --processes 8 stages/generate.py ...   # torchrun: each rank its own batches

OUT/summary.json holds only what the answers are; this run's timings and counts go to the metrics
file, so a rerun that adds no answer leaves OUT byte for byte as it was.
"""

from pathlib import Path

import click

from dflash_pipeline.foundation.runtime import OneLineCommand, device_option, offline_by_default, one_line_errors


@click.command(cls=OneLineCommand)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml", show_default=True)
@click.option("--prompts", "prompts_path", type=click.Path(path_type=Path), required=True,
              help="Prompt file (JSONL or Parquet); dvc.yaml passes generate.prompts.")
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default="data/generated", show_default=True)
@click.option("--metrics", "metrics_path", type=click.Path(path_type=Path), default="data/metrics/generate.json", show_default=True,
              help="This run's timings and answers reused / made (kept out of OUT).")
@device_option
@one_line_errors
def main(params_path: Path, prompts_path: Path, target_json: Path, out_dir: Path, metrics_path: Path, device: str) -> None:
    """Answer the first generate.max_prompts prompts greedily; resumes after an interruption."""
    offline_by_default()
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.generate.run import run_generate
    from dflash_pipeline.data.prompts import read_prompts
    from dflash_pipeline.foundation.files import write_metrics
    from dflash_pipeline.target.load import TargetInfo
    from dflash_pipeline.target.placement import TargetPlacement

    params = load_params(params_path)
    config = params.generate
    target = TargetInfo.from_json(target_json)
    prompt_set = read_prompts(
        prompts_path, val_fraction=config.val_fraction, on_bad_row=config.on_bad_row, limit=config.max_prompts
    )
    summary = run_generate(prompt_set, config=config, target=target, out_dir=out_dir, device=device,
                           source=str(params_path), placement=TargetPlacement.from_params(params, str(params_path)))
    if summary is None:  # a torchrun rank other than 0: rank 0 writes the splits and reports
        return
    write_metrics(metrics_path, summary["this_run"])
    prompts, tokens = summary["prompts"], summary["answer_tokens"]
    click.echo(
        f"generate: train {prompts['train']} prompts / {tokens['train']} answer tokens, "
        f"val {prompts['val']} / {tokens['val']}; finish {summary['finish_reasons']}; "
        f"skipped {sum(summary['skipped_rows'].values())} rows, {summary['duplicate_prompts']} duplicates"
    )


if __name__ == "__main__":
    main()
