"""The `dflash-pipeline` command group and what its commands share: the group itself, one-line
usage errors, the existing-folder argument type, comma-separated list options, and reading the
target, prompt and folder arguments the commands are given.

Each command lives in its own module of this package and registers itself on `main` when imported
(`dflash_pipeline.cli` imports them all).
"""

import tempfile
from pathlib import Path

import click

from dflash_pipeline import __version__
from dflash_pipeline.foundation.config import TargetConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.runtime import OneLineUsage, offline_by_default

EXISTING_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


class OneLineGroup(OneLineUsage, click.Group):
    """The command group: usage mistakes are one line `error: ...` and exit 1 (`runtime.OneLineUsage`)."""


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="dflash-pipeline")
def main():
    """DFlash drafter tools outside the DVC pipeline: score and compare drafters, decode with one,
    verify and inspect shards and checkpoints, export, and plot experiments.

    Hub downloads stay off unless HF_HUB_OFFLINE=0 is set. `dflash-pipeline COMMAND --help` shows
    a command's options and an example.
    """
    offline_by_default()


def comma_separated(kind: type, minimum: float, example: str):
    """A click callback parsing "a,b,c" into a list of `kind`, each at least `minimum`."""

    def parse(context, option, value: str) -> list:
        try:
            items = [kind(part) for part in value.split(",") if part.strip()]
        except ValueError:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of {kind.__name__}s, e.g. {example}") from None
        if any(item < minimum for item in items):
            raise click.BadParameter(f"{value!r}: every value must be >= {minimum:g}")
        return items

    return parse


# ----------------------------------------------------------------------------- the arguments' folders and files


def folder_kind(folder: Path) -> str:
    """What `folder` holds: a training "checkpoint" (checkpoint.json), a serving-format "drafter"
    (config.json), a capture "split" (manifest.json) or "splits" (a capture output of split folders)."""
    if (folder / "checkpoint.json").is_file():
        return "checkpoint"
    if (folder / "config.json").is_file():
        return "drafter"
    if (folder / "manifest.json").is_file():
        return "split"
    if split_folders(folder):
        return "splits"
    hint = " (a training run folder: name one of its step_NNNNNN folders)" if any(folder.glob("step_*/checkpoint.json")) else ""
    raise PipelineError(f"{folder}: not a checkpoint folder (checkpoint.json), a DFlash drafter folder (config.json) "
                        f"or a shard split folder (manifest.json){hint}")


def split_folders(folder: Path) -> list[Path]:
    """The split folders at `folder`: itself when it holds a manifest, else its subfolders that do."""
    if (folder / "manifest.json").is_file():
        return [folder]
    return sorted(p for p in folder.iterdir() if (p / "manifest.json").is_file()) if folder.is_dir() else []


def target_info(path: Path):
    """A target.json (or the target stage's folder holding one), or a local Hugging Face model
    folder, fingerprinted now exactly as the `target` stage would."""
    from dflash_pipeline.target.load import TargetInfo, prepare_target

    if path.is_file():
        return TargetInfo.from_json(path)
    if (path / "target.json").is_file():
        return TargetInfo.from_json(path / "target.json")
    if (path / "config.json").is_file():
        with tempfile.TemporaryDirectory(prefix="dflash-target-") as scratch:
            prepare_target(TargetConfig(model=str(path.resolve())), out_dir=Path(scratch))
            return TargetInfo.from_json(Path(scratch) / "target.json")  # it records the model's absolute path
    raise PipelineError(f"{path}: neither a target.json nor a Hugging Face model folder (config.json)")


def generated_val(path: Path | None) -> Path | None:
    """The generate stage's val.parquet (given as the file or its folder), its schema checked."""
    from dflash_pipeline.data.prompts import read_generated

    if path is None:
        return None
    path = path / "val.parquet" if path.is_dir() else path
    read_generated(path)
    return path
