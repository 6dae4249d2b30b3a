"""`dflash-pipeline verify`: one check of a whole run against the digests its files carry.

Every file a later stage trusts carries its sha256 in the JSON or `.sha256` record beside it, and
each stage checks it where it loads the file (docs/stages.md, "Checks and recovery", lists them).
This module checks them all at once, for a run's folders:

    target       target.json's `files` (the converted embedded model)
    generated    generate's train/val.parquet and resume chunks, each against its `.sha256` record
    shards       each split's manifest.json: every shard's sha256, and no shard it does not list
    checkpoints  each step folder's checkpoint.json: the weights and the step's resume state
    best choice  evaluate's best.json against its `.sha256` record (export acts on it)
    export       dflash_pipeline.json's `files`
    leftovers    a staging folder (`data/hidden.partial`) beside an output that is complete
    DVC cache    every cache object that dvc.lock's outputs name must hash (md5) to its own name

Why the cache too: with `cache.type hardlink` an output file and its cache object are one inode, so
a flipped bit in one is in both, and DVC trusts its cache without rehashing (what `repair` does
about it: repair.py).
"""

from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.data.shards import SHARD_GLOB, Manifest
from dflash_pipeline.drafters.checkpoints import (
    INFO_FILE,
    WEIGHTS_FILE,
    read_checkpoint_info,
    resume_state_problem,
    state_path,
    weights_problem,
)
from dflash_pipeline.drafters.serving import PROVENANCE_FILE, provenance_problems
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import digest_problem, read_json, recorded_digest_problem, staging_dir
from dflash_pipeline.foundation.tensor_files import safetensors_header
from dflash_pipeline.integrity.dvc_repository import dvc_cache_dir, file_md5, lock_objects

# The pipeline's outputs, as dvc.yaml names them.
DEFAULT_PATHS = {"target": "data/target/target.json", "generated": "data/generated", "hidden": "data/hidden",
                 "checkpoints": "data/checkpoints", "eval": "data/eval", "export": "data/export/drafter"}


@dataclass(frozen=True)
class Finding:
    """One thing wrong with a run: `path` and the line that says what."""

    path: Path
    problem: str
    kind: str  # "damaged" (a file of the run), "cache" (a DVC cache object), "leftover" (a staging folder)
    backs: tuple[Path, ...] = ()  # a cache object: the output files it is the content of


@dataclass(frozen=True)
class RunPaths:
    """Where a run's outputs are (dvc.yaml's defaults, relative to `root`, unless given)."""

    root: Path
    target: Path
    generated: Path
    hidden: Path
    checkpoints: Path
    eval: Path
    export: Path

    @classmethod
    def at(cls, root: Path, **given) -> "RunPaths":
        root = Path(root)
        return cls(root=root, **{name: Path(given.get(name) or root / default) for name, default in DEFAULT_PATHS.items()})


# ----------------------------------------------------------------------------- the run's own digests


def check_target(target_json: Path) -> list[Finding]:
    """Every file target.json records a sha256 of (the conversion the target stage wrote)."""
    if not target_json.is_file():
        return []
    try:
        data = read_json(target_json, missing="missing")
    except PipelineError as exc:
        return [Finding(target_json, str(exc), "damaged")]
    recorded = data.get("files") or {} if isinstance(data, dict) else {}
    findings = []
    for name, digest in sorted(recorded.items()):
        problem = digest_problem(target_json.parent / name, digest, recorded_in=target_json)
        if problem:
            findings.append(Finding(target_json.parent / name, problem, "damaged"))
    return findings


def check_recorded_files(folder: Path, pattern: str) -> list[Finding]:
    """Every file of `folder` matching `pattern` that has a `.sha256` record beside it (generate's
    Parquet files, evaluate's best.json) and does not match it. A file without a record has
    nothing to check: one from before records (and generate answers such a chunk again itself)."""
    if not folder.is_dir():
        return []
    findings = []
    for path in sorted(folder.glob(pattern)):
        problem = recorded_digest_problem(path) if path.is_file() else None
        if problem:
            findings.append(Finding(path, problem, "damaged"))
    return findings


def check_generated(generated: Path) -> list[Finding]:
    """generate's train/val.parquet and its resume chunks against their sha256 records."""
    return check_recorded_files(generated, "*.parquet") + check_recorded_files(generated / "chunks", "chunk-*.parquet")


def _split_folders(hidden: Path) -> list[Path]:
    return sorted(path.parent for path in hidden.glob("*/manifest.json")) if hidden.is_dir() else []


def check_shards(hidden: Path) -> list[Finding]:
    """Every shard of every split against its manifest's sha256, and no shard the manifest does not list."""
    findings = []
    for split in _split_folders(hidden):
        try:
            manifest = Manifest.load(split)
        except PipelineError as exc:
            findings.append(Finding(split / "manifest.json", str(exc), "damaged"))
            continue
        listed = {info.file for info in manifest.shards}
        for info in manifest.shards:
            problem = digest_problem(split / info.file, info.sha256, recorded_in=split / "manifest.json")
            if problem:
                findings.append(Finding(split / info.file, problem, "damaged"))
        for extra in sorted(path for path in split.glob(SHARD_GLOB) if path.name not in listed):
            findings.append(Finding(extra, f"{extra}: shard not listed in the manifest (foreign or left from another run)", "damaged"))
    return findings


def step_folders(checkpoints: Path) -> list[Path]:
    """The `step_NNNNNN` folders of a checkpoints folder, oldest first."""
    return sorted(path for path in checkpoints.glob("step_*") if path.is_dir() and path.name[5:].isdigit())


def check_checkpoints(checkpoints: Path) -> list[Finding]:
    """Every step folder: checkpoint.json readable, the weights and the resume state matching the
    digests it records (a checkpoint from before digests: its weights must at least parse)."""
    findings = []
    for folder in step_folders(checkpoints):
        try:
            info = read_checkpoint_info(folder)
        except PipelineError as exc:
            findings.append(Finding(folder / INFO_FILE, str(exc), "damaged"))
            continue
        problem = weights_problem(folder, info)
        if problem is None and not info.get("weights_sha256"):
            try:
                safetensors_header(folder / WEIGHTS_FILE)
            except PipelineError as exc:
                problem = str(exc)
        if problem:
            findings.append(Finding(folder / WEIGHTS_FILE, problem, "damaged"))
        state = state_path(checkpoints, int(folder.name[5:]))
        problem = resume_state_problem(state, info, folder) if state.is_file() else None
        if problem:
            findings.append(Finding(state, problem, "damaged"))
    return findings


def check_export(export: Path) -> list[Finding]:
    """Every file of an export against dflash_pipeline.json's digests (a published drafter has none)."""
    provenance_file = export / PROVENANCE_FILE
    if not provenance_file.is_file():
        return []
    try:
        provenance = read_json(provenance_file, missing="missing")
    except PipelineError as exc:
        return [Finding(provenance_file, str(exc), "damaged")]
    return [Finding(Path(problem.split(": ", 1)[0]), problem, "damaged") for problem in provenance_problems(export, provenance)]


def check_leftovers(paths: RunPaths) -> list[Finding]:
    """A staging folder beside an output that is complete: a killed run's work that no run will
    resume (DVC served the output from its run cache, or a later run finished it)."""
    staging = staging_dir(paths.hidden)
    complete = all((paths.hidden / split / "manifest.json").is_file() for split in ("train", "val"))
    if staging.is_dir() and complete:
        return [Finding(staging, f"{staging}: staging folder of a killed capture; {paths.hidden} is complete without it", "leftover")]
    return []


# ----------------------------------------------------------------------------- the DVC cache


def check_cache(root: Path) -> list[Finding]:
    """Every cache object dvc.lock's outputs name whose content does not hash to its name. An
    object that is absent is not damage (never pushed here, or collected): DVC says so itself."""
    cache = dvc_cache_dir(root)
    if cache is None or not cache.is_dir():
        return []
    findings = []
    for obj, outputs in sorted(lock_objects(root, cache).items()):
        if not obj.is_file():
            continue
        expected = obj.parent.name + obj.name.removesuffix(".dir")
        actual = file_md5(obj)
        if actual != expected:
            shown = ", ".join(str(path) for path in outputs[:2]) + (f" and {len(outputs) - 2} more" if len(outputs) > 2 else "")
            findings.append(Finding(obj, f"{obj}: DVC cache object of {shown} is damaged (md5 {actual[:12]}..., its name says "
                                         f"{expected[:12]}...)", "cache", tuple(outputs)))
    return findings


def check_run(paths: RunPaths) -> list[Finding]:
    """Everything wrong with the run at `paths`, in the order of the pipeline, then the DVC cache."""
    return (check_target(paths.target) + check_generated(paths.generated) + check_shards(paths.hidden)
            + check_checkpoints(paths.checkpoints) + check_recorded_files(paths.eval, "best.json") + check_export(paths.export)
            + check_leftovers(paths) + check_cache(paths.root))
