"""DVC stage `export`: the drafter chosen by `evaluate`, in the public DFlash serving format.

    python stages/export.py --params params.yaml --best data/eval/best.json --out data/export/drafter

The folder loads unchanged in z-lab/dflash (`DFlashDraftModel.from_pretrained`), SGLang
(`--speculative-algorithm DFLASH --speculative-draft-model-path data/export/drafter`) and vLLM. Its
provenance file also records the decoding mode evaluate measured fastest for the checkpoint
(best.json's `best_mode`), which `dflash-pipeline decode` decodes with at T = 0.
"""

from pathlib import Path

import click

from dflash_pipeline.foundation.runtime import OneLineCommand, one_line_errors


@click.command(cls=OneLineCommand)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml", show_default=True)
@click.option("--best", "best_json", type=click.Path(path_type=Path), default="data/eval/best.json", show_default=True,
              help="The evaluate stage's choice (highest teacher-forced tau).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default="data/export/drafter", show_default=True)
@one_line_errors
def main(params_path, best_json, out_dir):
    """Export the chosen checkpoint to OUT (config.json + model.safetensors)."""
    import torch

    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.foundation.errors import PipelineError
    from dflash_pipeline.export.run import export_checkpoint
    from dflash_pipeline.foundation.files import check_recorded_digest, read_json
    from dflash_pipeline.foundation.stats import format_interval

    config = load_params(params_path).export
    if best_json.is_file():
        check_recorded_digest(best_json)  # which checkpoint to publish: a flipped bit must not pick another
    best = read_json(best_json, missing="no evaluation choice; run the `evaluate` stage first (dvc repro evaluate)")
    if best.get("kind") != "checkpoint":
        raise PipelineError(f"{best_json}: the chosen drafter is a {best.get('kind')!r}, not a checkpoint of this run; nothing to export")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    best_mode = best.get("best_mode")  # absent in a best.json written before evaluate recorded it; null when nothing was decoded
    if best_mode is not None and not isinstance(best_mode, dict):
        raise PipelineError(f"{best_json}: best_mode is {type(best_mode).__name__}, expected a mapping (evaluate's best decoding mode)")
    folder = export_checkpoint(Path(best["path"]), out_dir, dtype=dtype, best_mode=best_mode)
    mode = f"; best mode {best_mode.get('mode') or 'none'}, speedup {best_mode.get('speedup')}" if best_mode else ""
    click.echo(f"export: {best['name']} (teacher-forced tau {format_interval(best['tau'], best['tau_ci95'], digits=4)}{mode}) -> {folder} "
               f"({config.dtype})")


if __name__ == "__main__":
    main()
