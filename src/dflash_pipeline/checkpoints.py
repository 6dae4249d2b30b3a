"""Training checkpoints on disk: save, load, list, and the resume state.

A run's output folder holds

    step_NNNNNN/model.safetensors   the drafter's weights (no pickle)
    step_NNNNNN/checkpoint.json     step, drafter config, metrics, git revision, run record
    state.pt                        resume state of the latest checkpoint: step, optimizer moments,
                                    RNG, curve so far, the run's record (plain tensors/containers,
                                    loaded with weights_only)
    state.json                      a readable copy of state.pt's step, curve and record

Every file appears whole or not at all: a step folder is renamed into place when complete and
state.pt is replaced atomically.
"""

import json
import os
import shutil
from pathlib import Path

import torch

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.files import write_json_atomic
from dflash_pipeline.model import DFlashDrafter, DrafterConfig

CHECKPOINT_FORMAT_VERSION = 1


def git_revision() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def step_folder(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step_{step:06d}"


def save_checkpoint(out_dir: Path, *, step: int, drafter: DFlashDrafter, record: dict, metrics: dict) -> Path:
    """step_NNNNNN/{model.safetensors, checkpoint.json}, renamed into place when complete."""
    from safetensors.torch import save_file

    final = step_folder(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in drafter.state_dict().items()}
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    info = {"format_version": CHECKPOINT_FORMAT_VERSION, "step": step, "drafter": drafter.config.to_dict(),
            "git_revision": git_revision(), "metrics": metrics, **record}
    (tmp / "checkpoint.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_checkpoint(folder: Path, *, device: str = "cpu") -> tuple[DFlashDrafter, dict]:
    """A drafter from a step folder: weights from safetensors (no pickle), config from its JSON."""
    from safetensors.torch import load_file

    try:
        info = json.loads((Path(folder) / "checkpoint.json").read_text())
    except FileNotFoundError:
        raise PipelineError(f"{folder}: no checkpoint.json (not a checkpoint folder)") from None
    if info.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise PipelineError(f"{folder}/checkpoint.json: format_version {info.get('format_version')!r}, expected {CHECKPOINT_FORMAT_VERSION}")
    drafter = DFlashDrafter(DrafterConfig.from_dict(info["drafter"]))
    drafter.load_state_dict(load_file(Path(folder) / "model.safetensors", device="cpu"))
    return drafter.to(device), info


def list_checkpoints(out_dir: Path) -> list[Path]:
    """The complete step folders of a run, oldest first."""
    return sorted(p for p in Path(out_dir).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / "checkpoint.json").is_file())


def save_resume_state(out_dir: Path, *, step: int, optimizer, curve: list[dict], record: dict, extra: dict | None = None) -> None:
    """Everything needed to continue exactly, in ONE file replaced atomically: step, optimizer
    moments, RNG, curve so far and the run's settings. (Two files written one after the other
    let a kill between them pair one step's optimizer with another step's weights.) `extra`: more
    plain values to carry over (the loss window, token and time totals). state.json repeats step,
    curve and settings for people and tools; resuming never reads it."""
    state = {"step": step, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(), "curve": curve, "record": record,
             **(extra or {})}
    tmp = Path(out_dir) / "state.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, Path(out_dir) / "state.pt")
    write_json_atomic(Path(out_dir) / "state.json", {"step": step, "curve": curve, **record})


def load_resume_state(out_dir: Path, record: dict) -> dict | None:
    """The saved state (state.pt) when it belongs to this exact run configuration, else None."""
    try:
        state = torch.load(Path(out_dir) / "state.pt", weights_only=True)
    except FileNotFoundError:
        return None
    except Exception:  # not loadable as plain tensors and containers (another program's file): start fresh
        return None
    if state.get("record") != record or not step_folder(out_dir, state["step"]).is_dir():
        return None
    return state
