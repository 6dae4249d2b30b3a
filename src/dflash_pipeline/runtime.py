"""Process-level helpers shared by the stage commands: device choice, offline mode, error exits."""

import functools
import os
import sys

import click

from dflash_pipeline.errors import PipelineError


def default_device() -> str:
    """CUDA when present (bf16 compute there), else CPU (fp32: this CPU class lacks bf16 units)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def offline_by_default() -> None:
    """Hub downloads are off unless the user turned them on (HF_HUB_OFFLINE=0).

    Set before transformers is imported, since huggingface_hub reads the variable at import.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def one_line_errors(command):
    """Turn a PipelineError into `error: <message>` on stderr and exit status 1, no traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PipelineError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)

    return wrapper
