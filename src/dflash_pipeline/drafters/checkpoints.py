"""Training checkpoints on disk: save, load, list, and the resume state.

A run's output folder holds

    step_NNNNNN/model.safetensors   the drafter's weights (no pickle)
    step_NNNNNN/checkpoint.json     step, drafter config, metrics, git revision, run record, and the
                                    sha256 of the weights and of the step's resume state
    state/step_NNNNNN.pt            resume state of that checkpoint, for the newest two: step,
                                    optimizer moments, RNG, curve so far, the run's record (plain
                                    tensors/containers, loaded with weights_only)
    state.json                      a readable copy of the newest state's step, curve and record

Every file appears whole or not at all: a step's resume state is written under a temporary name
and renamed, then its folder (which records the state's digest) is renamed into place when
complete, then state.json follows. A file can still be damaged later (a disk, a copy cut short, a
hand, a flipped bit in a hard-linked DVC cache file): every load checks the digests
checkpoint.json records, so resuming takes the newest step whose folder loads, whose weights and
state match their digests and whose state belongs to this run, and says which newer steps it
passed over and why; keeping two states is what leaves an intact older step to fall back on.
`evaluate`, `export` and the console command load through `load_checkpoint` and refuse a damaged
one in one line. A checkpoint written before digests existed records none and loads unchecked.
"""

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import digest_problem, sha256_file, write_json_atomic

CHECKPOINT_FORMAT_VERSION = 1
INFO_FILE = "checkpoint.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FOLDER = "state"
KEEP_STATES = 2  # the newest checkpoint's, and one to fall back on when the newest is damaged


def git_revision() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def step_folder(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step_{step:06d}"


def save_checkpoint(out_dir: Path, *, step: int, drafter: DFlashDrafter, record: dict, metrics: dict,
                    resume_state: Path | None = None) -> Path:
    """step_NNNNNN/{model.safetensors, checkpoint.json}, renamed into place when complete.
    checkpoint.json records the sha256 of the weights and, when given, of the step's resume state."""
    from safetensors.torch import save_file

    final = step_folder(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in drafter.state_dict().items()}
    save_file(weights, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
    info = {"format_version": CHECKPOINT_FORMAT_VERSION, "step": step, "drafter": drafter.config.to_dict(),
            "git_revision": git_revision(), "metrics": metrics, **record, "weights_sha256": sha256_file(tmp / WEIGHTS_FILE)}
    if resume_state is not None:
        info["resume_state_sha256"] = sha256_file(resume_state)
    write_json_atomic(tmp / INFO_FILE, info)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def weights_problem(folder: Path, info: dict) -> str | None:
    """Whether the step folder's weights are the ones its checkpoint.json records (None: they are,
    or it records no digest)."""
    folder = Path(folder)
    return digest_problem(folder / WEIGHTS_FILE, info.get("weights_sha256"), recorded_in=folder / INFO_FILE)


def resume_state_problem(state_file: Path, info: dict | None, folder: Path) -> str | None:
    """Whether `state_file` is the resume state the step folder's checkpoint.json records (None: it
    is, or nothing is recorded)."""
    return digest_problem(state_file, (info or {}).get("resume_state_sha256"), recorded_in=Path(folder) / INFO_FILE)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_checkpoint_info(folder: Path) -> dict:
    """A step folder's checkpoint.json, checked for its format; one PipelineError line naming it otherwise."""
    folder = Path(folder)
    info_path = folder / INFO_FILE
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{folder}: no checkpoint.json (not a checkpoint folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PipelineError(f"{info_path}: not valid JSON ({_one_line(exc)})") from None
    if not isinstance(info, dict) or info.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        version = info.get("format_version") if isinstance(info, dict) else None
        raise PipelineError(f"{info_path}: format_version {version!r}, expected {CHECKPOINT_FORMAT_VERSION}")
    return info


def load_checkpoint(folder: Path, *, device: str = "cpu") -> tuple[DFlashDrafter, dict]:
    """A drafter from a step folder: weights from safetensors (no pickle), config from its JSON.
    A missing, cut, damaged (its sha256 is not the recorded one) or foreign file is one
    PipelineError line naming it."""
    from dflash_pipeline.foundation.tensor_files import load_safetensors, safetensors_header

    folder = Path(folder)
    info_path, weights_path = folder / INFO_FILE, folder / WEIGHTS_FILE
    info = read_checkpoint_info(folder)
    try:
        drafter = DFlashDrafter(DrafterConfig.from_dict(info["drafter"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise PipelineError(f"{info_path}: drafter config unusable ({_one_line(exc)})") from None
    safetensors_header(weights_path)  # a missing or cut file says so; the digest then finds what still parses
    problem = weights_problem(folder, info)
    if problem:
        raise PipelineError(problem)
    weights = load_safetensors(weights_path)
    try:
        drafter.load_state_dict(weights)
    except RuntimeError as exc:
        raise PipelineError(f"{weights_path}: weights do not fit the drafter of checkpoint.json ({_one_line(exc)})") from None
    return drafter.to(device), info


def list_checkpoints(out_dir: Path) -> list[Path]:
    """The complete step folders of a run, oldest first."""
    return sorted(p for p in Path(out_dir).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / "checkpoint.json").is_file())


def state_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / STATE_FOLDER / f"step_{step:06d}.pt"


def _step_number(path: Path) -> int | None:
    digits = path.name.removeprefix("step_").removesuffix(".pt")
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def save_resume_state(out_dir: Path, *, step: int, optimizer, curve: list[dict], record: dict, extra: dict | None = None) -> Path:
    """Everything needed to continue exactly from checkpoint `step`, in ONE file written atomically:
    step, optimizer moments, RNG, curve so far and the run's settings. (Two files written one after
    the other let a kill between them pair one step's optimizer with another step's weights.)
    `extra`: more plain values to carry over (the loss window, token and time totals). The newest
    KEEP_STATES files are kept. Returns the file, whose digest the step's checkpoint.json records
    (`save_step` writes the three in order)."""
    out_dir = Path(out_dir)
    state = {"step": step, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(), "curve": curve, "record": record,
             **(extra or {})}
    final = state_path(out_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, final)
    kept = sorted((p for p in final.parent.glob("step_*.pt") if _step_number(p) is not None), key=_step_number)
    for old in kept[:-KEEP_STATES]:
        old.unlink()
    (out_dir / "state.pt").unlink(missing_ok=True)  # the single state file of earlier versions
    return final


def save_step(out_dir: Path, *, step: int, drafter: DFlashDrafter, optimizer, curve: list[dict], record: dict, metrics: dict,
              extra: dict | None = None) -> Path:
    """A checkpoint and its resume state, in the order that leaves every kill resumable: the state
    file (renamed into place), then the step folder that records its digest (renamed into place:
    from here the step counts), then state.json, which repeats step, curve and settings for people
    and tools (resuming never reads it). Returns the step folder."""
    state_file = save_resume_state(out_dir, step=step, optimizer=optimizer, curve=curve, record=record, extra=extra)
    folder = save_checkpoint(out_dir, step=step, drafter=drafter, record=record, metrics=metrics, resume_state=state_file)
    write_json_atomic(Path(out_dir) / "state.json", {"step": step, "curve": curve, **record})
    return folder


@dataclass
class ResumePoint:
    """What a run folder offers: the newest step to continue from (0 and no state: nothing), the
    newer steps passed over with why, and whether anything there was made by this configuration."""

    step: int = 0
    state: dict | None = None
    drafter: DFlashDrafter | None = None
    skipped: list[str] = field(default_factory=list)  # "step_000006: <file>: <why>", newest first
    same_configuration: bool = False
    other_record: dict | None = None  # the run record of the newest checkpoint made by another configuration


def record_changes(old: dict, new: dict, *, limit: int = 3) -> str:
    """What differs between two run records, key by dotted key: "train_config.max_steps 40 -> 50"."""
    def flat(value, prefix=""):
        if isinstance(value, dict):
            items = {}
            for key, item in value.items():
                items.update(flat(item, f"{prefix}{key}."))
            return items
        return {prefix.rstrip("."): value}

    def shown(value):  # a sha256 (a manifest's) is told apart by its first 12 hex digits
        digest = isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
        return f"{value[:12]}..." if digest else repr(value)

    before, after = flat(_plain(old)), flat(_plain(new))
    changed = [f"{key} {shown(before.get(key, '(none)'))} -> {shown(after.get(key, '(none)'))}"
               for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
    return ", ".join(changed[:limit]) + (f" and {len(changed) - limit} more" if len(changed) > limit else "")


def _plain(value):
    """`value` as it reads back from JSON (tuples become lists), to compare with a JSON record."""
    return json.loads(json.dumps(value, sort_keys=True))


def _load_state(path: Path) -> dict | None:
    try:
        state = torch.load(path, weights_only=True)
    except Exception:  # cut short, or not plain tensors and containers (another program's file)
        return None
    return state if isinstance(state, dict) and isinstance(state.get("step"), int) else None


def _read_info(folder: Path) -> dict | None:
    """`folder`'s checkpoint.json as a dict, or None when it is missing or unreadable."""
    try:
        info = json.loads((folder / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def load_resume_state(out_dir: Path, record: dict) -> ResumePoint:
    """The newest checkpoint of this exact run configuration that can be continued: its state file
    matches the digest its checkpoint.json records, loads and carries `record`, and its folder
    loads (weights matching their digest). Newer steps that fail any of these are listed in
    `skipped` with the reason; nothing is removed here."""
    out_dir = Path(out_dir)
    states = {_step_number(p): p for p in (out_dir / STATE_FOLDER).glob("step_*.pt") if _step_number(p) is not None}
    legacy_file = out_dir / "state.pt"
    legacy = _load_state(legacy_file) if legacy_file.is_file() else None
    if legacy is not None and legacy["step"] not in states:
        states[legacy["step"]] = legacy_file
    folders = {_step_number(p) for p in out_dir.glob("step_*") if p.is_dir() and _step_number(p) is not None}
    wanted = _plain(record)
    point = ResumePoint()
    for step in sorted(set(states) | folders, reverse=True):
        folder, state_file = step_folder(out_dir, step), states.get(step, state_path(out_dir, step))
        info = _read_info(folder)
        damaged = resume_state_problem(state_file, info, folder) if step in states else None
        state = None
        if step in states and not damaged:
            state = legacy if state_file == legacy_file else _load_state(state_file)
        recorded = _plain({key: info.get(key) for key in record}) if info is not None else None
        folder_matches = recorded == wanted
        if recorded is not None and not folder_matches and point.other_record is None:
            point.other_record = recorded
        if folder_matches or (state is not None and state.get("record") == record):
            point.same_configuration = True
        drafter = None
        if not folder.is_dir():
            reason = f"{folder}: checkpoint folder missing"
        elif step not in states:
            # A step's state is written before its folder, so a folder without one lost it after:
            # to the keep-two rule when a newer step was saved, or with the newer steps removed since
            # (`dflash-pipeline verify --repair` removes a damaged step with every newer one).
            why = f"only the newest {KEEP_STATES} checkpoints keep one"
            if not any(other > step for other in states):
                why += ", and the newer steps that had one were removed"
            reason = f"{state_file}: no resume state ({why})"
        elif damaged:
            reason = damaged
        elif state is None:
            reason = f"{state_file}: unreadable resume state"
        elif state.get("record") != record or state["step"] != step:
            reason = f"{state_file}: made by a different run configuration"
        else:
            try:
                drafter, _ = load_checkpoint(folder)
                reason = None if folder_matches else f"{folder / INFO_FILE}: made by a different run configuration"
            except PipelineError as exc:
                reason = str(exc)
        if reason is None:
            point.step, point.state, point.drafter = step, state, drafter
            return point
        point.skipped.append(f"{folder.name}: {reason}")
    return point


def remove_checkpoints(out_dir: Path, *, newer_than: int = -1) -> int:
    """Remove the step folders and resume states after step `newer_than` (all of them by default,
    with state.json); return how many step folders went."""
    out_dir = Path(out_dir)
    removed = 0
    for folder in out_dir.glob("step_*"):
        step = _step_number(Path(folder.name.removesuffix(".tmp")))
        if folder.is_dir() and step is not None and step > newer_than:
            shutil.rmtree(folder)
            removed += not folder.name.endswith(".tmp")
    for path in (out_dir / STATE_FOLDER).glob("step_*.pt*"):
        step = _step_number(Path(path.name.removesuffix(".tmp")))
        if step is not None and step > newer_than:
            path.unlink()
    if newer_than < 0:
        (out_dir / "state.pt").unlink(missing_ok=True)
        (out_dir / "state.json").unlink(missing_ok=True)
    else:
        try:
            stale = json.loads((out_dir / "state.json").read_text())["step"] > newer_than
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
            stale = False
        if stale:  # it described a step removed now; the next checkpoint writes it again
            (out_dir / "state.json").unlink()
    return removed
