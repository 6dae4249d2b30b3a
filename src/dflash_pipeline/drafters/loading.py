"""Loading one drafter folder for a target: a training checkpoint or a serving-format export,
refused in one line unless it belongs to this target and these shards.

    drafter_folder_kind    "checkpoint" (checkpoint.json) or "export" (config.json), else None
    check_drafter_contract the drafter's shapes and taps against the target's (and the shards' layers)
    load_checked_checkpoint / load_checked_export / load_drafter_folder
                           load, then check the recorded target fingerprint and the contract

Evaluate loads its candidates through these; `dflash-pipeline decode` loads the drafter it is given.
"""

from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.drafters.checkpoints import load_checkpoint
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.serving import load_dflash_drafter
from dflash_pipeline.foundation.errors import PipelineError


@dataclass
class LoadedDrafter:
    """A drafter checked against a target, with where it came from."""

    drafter: DFlashDrafter
    kind: str  # "checkpoint" | "export"
    path: Path
    step: int | None = None  # a checkpoint's training step
    info: dict = field(default_factory=dict)  # checkpoint.json, or the export's provenance


def drafter_folder_kind(folder: Path) -> str | None:
    """"checkpoint" for a training checkpoint, "export" for a serving-format drafter, else None."""
    if (folder / "checkpoint.json").is_file():
        return "checkpoint"
    if (folder / "config.json").is_file():
        return "export"
    return None


def check_drafter_contract(config: DrafterConfig, *, target, layer_ids: list[int] | None, source: str) -> None:
    """Refuse a drafter that cannot run on this target and these shards, naming the field."""
    expected = [("hidden_size", target.hidden_size, "target"), ("vocab_size", target.vocab_size, "target"),
                ("num_target_layers", target.num_layers, "target")]
    if layer_ids is not None:
        expected.append(("target_layer_ids", list(layer_ids), "shards"))
    for name, value, owner in expected:
        actual = getattr(config, name)
        actual = list(actual) if isinstance(actual, tuple) else actual
        if actual != value:
            raise PipelineError(f"{source}: drafter {name} is {actual!r}, but the {owner} has {value!r}")
    if config.block_size < 2:
        raise PipelineError(f"{source}: drafter block_size is {config.block_size}, it must be >= 2")
    if not 0 <= config.mask_token_id < config.vocab_size:
        raise PipelineError(f"{source}: drafter mask_token_id {config.mask_token_id} is outside the vocabulary (0..{config.vocab_size - 1})")


def _short(fingerprint) -> str:
    return f"{str(fingerprint)[:12]}..."


def load_checked_checkpoint(folder: Path, *, target, layer_ids: list[int] | None, device: str) -> LoadedDrafter:
    """A checkpoint of this pipeline: it must name this very target's fingerprint."""
    drafter, info = load_checkpoint(folder, device=device)
    if info.get("target_fingerprint") != target.fingerprint:
        raise PipelineError(f"{folder}/checkpoint.json: target_fingerprint {_short(info.get('target_fingerprint'))} "
                            f"is not this target's {_short(target.fingerprint)}")
    check_drafter_contract(drafter.config, target=target, layer_ids=layer_ids, source=str(folder / "checkpoint.json"))
    return LoadedDrafter(drafter=drafter, kind="checkpoint", path=folder, step=int(info["step"]), info=info)


def load_checked_export(directory: Path, *, target, layer_ids: list[int] | None, device: str) -> LoadedDrafter:
    """A serving-format drafter: one exported by this pipeline names its target (dflash_pipeline.json);
    a published drafter carries no fingerprint, and only its shapes and taps can be checked."""
    directory = Path(directory)
    drafter, info = load_dflash_drafter(directory, device=device)
    trained_for = ((info.get("provenance") or {}).get("source") or {}).get("target_fingerprint")
    if trained_for is not None and trained_for != target.fingerprint:
        raise PipelineError(f"{directory}/dflash_pipeline.json: source.target_fingerprint {_short(trained_for)} "
                            f"is not this target's {_short(target.fingerprint)}")
    check_drafter_contract(drafter.config, target=target, layer_ids=layer_ids, source=str(directory / "config.json"))
    return LoadedDrafter(drafter=drafter, kind="export", path=directory, info=info)


def load_drafter_folder(folder: Path, *, target, layer_ids: list[int] | None = None, device: str) -> LoadedDrafter:
    """Whichever of the two `folder` holds, checked; anything else is refused naming what a drafter folder holds."""
    folder = Path(folder)
    kind = drafter_folder_kind(folder)
    if kind is None:
        hint = " (a training run folder: name one of its step_NNNNNN folders)" if any(folder.glob("step_*/checkpoint.json")) else ""
        raise PipelineError(f"{folder}: not a drafter: no checkpoint.json (a training checkpoint) or config.json "
                            f"(a DFlash drafter folder){hint}")
    load = load_checked_checkpoint if kind == "checkpoint" else load_checked_export
    return load(folder, target=target, layer_ids=layer_ids, device=device)
