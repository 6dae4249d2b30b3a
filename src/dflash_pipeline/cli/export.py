"""`dflash-pipeline export`: a training checkpoint written in the DFlash serving format
(`export.run.export_checkpoint`) and loaded back before it reports success."""

from pathlib import Path

import click

from dflash_pipeline.cli.group import EXISTING_DIR, main
from dflash_pipeline.foundation.runtime import one_line_errors


@main.command(short_help="Export a checkpoint to the DFlash serving format.")
@click.argument("checkpoint", type=EXISTING_DIR)
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weights dtype: float32 is the checkpoint bit for bit; bfloat16 halves the files, as published drafters ship.")
@one_line_errors
def export(checkpoint, out, dtype):
    """Export a training checkpoint to the DFlash serving format (config.json + model.safetensors).

    OUT is replaced only if it is absent, empty or an earlier drafter export. The written folder is
    loaded back before the command reports success. It loads in z-lab's DFlashDraftModel, SGLang
    (--speculative-algorithm DFLASH) and vLLM (method: dflash).

    \b
    Example:
      dflash-pipeline export data/checkpoints/step_000900 out/drafter --dtype bfloat16
    """
    import torch

    from dflash_pipeline.export.run import export_checkpoint
    from dflash_pipeline.drafters.serving import load_dflash_drafter

    folder = export_checkpoint(checkpoint, out, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    drafter, _ = load_dflash_drafter(folder)
    config = drafter.config
    click.echo(f"export: {checkpoint} -> {folder} ({dtype}; drafter layers {config.num_layers}, block size {config.block_size}, "
               f"target layer ids {list(config.target_layer_ids)})")
