"""Stage `export`: a training checkpoint in the public DFlash serving format (`serving`).

The folder records where it came from (checkpoint, step, target fingerprint, git revision) in its
provenance file, so `evaluate` can refuse it for another target and `show` can say what it is.
"""

from pathlib import Path

import torch

from dflash_pipeline.drafters.checkpoints import load_checkpoint
from dflash_pipeline.drafters.serving import export_drafter


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Export a training checkpoint folder (step_NNNNNN/) to `out_dir`, recording its origin."""
    drafter, info = load_checkpoint(checkpoint_dir)
    source = {"checkpoint": str(checkpoint_dir), "step": info.get("step"),
              "target_fingerprint": info.get("target_fingerprint"), "git_revision": info.get("git_revision")}
    return export_drafter(drafter, out_dir, dtype=dtype, source=source)
