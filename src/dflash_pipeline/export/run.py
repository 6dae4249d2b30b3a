"""Stage `export`: a training checkpoint in the public DFlash serving format (`serving`).

The folder records where it came from (checkpoint, step, target fingerprint, git revision) in its
provenance file, so `evaluate` can refuse it for another target and `show` can say what it is;
and, when the export stage passes it on from evaluate's best.json, the decoding mode evaluate
measured fastest for it (`source.best_mode`), which `dflash-pipeline decode` then decodes with.
"""

from pathlib import Path

import torch

from dflash_pipeline.drafters.checkpoints import load_checkpoint
from dflash_pipeline.drafters.serving import export_drafter


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, *, dtype: torch.dtype = torch.float32, best_mode: dict | None = None) -> Path:
    """Export a training checkpoint folder (step_NNNNNN/) to `out_dir`, recording its origin and,
    given evaluate's `best_mode` of this checkpoint (best.json's section), that too."""
    drafter, info = load_checkpoint(checkpoint_dir)
    source = {"checkpoint": str(checkpoint_dir), "step": info.get("step"),
              "target_fingerprint": info.get("target_fingerprint"), "git_revision": info.get("git_revision")}
    if best_mode is not None:
        source["best_mode"] = best_mode
    return export_drafter(drafter, out_dir, dtype=dtype, source=source)
