"""`dflash-pipeline verify`: one check of a whole run against the digests its files carry, and the
repair that lets DVC bring good copies back.

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
a flipped bit in one is in both, and DVC trusts its cache without rehashing. `dvc repro` then
restores the damaged object from the run cache, `dvc checkout --relink` links a rebuilt good file
back to it, and `dvc pull` sees the object present and fetches nothing. So `repair` removes what is
damaged, in the workspace and in the cache, and `dvc pull` (from a remote) or `dvc repro`
(recomputed) brings good copies:

- a damaged file of the run goes, with every cache object that is the same file (a hard link);
  for a checkpoint, its step folder and every newer step go with it, and train writes them again,
  byte for byte on a CPU: from the newest step left that still has its resume state (only the
  newest two steps keep one, so that is the step before only when the damaged step was the
  newest), else from the start; `repair` says which;
- a damaged cache object is restored from its output's good copy when the workspace holds one
  (a separate file whose md5 is the object's name), and removed otherwise;
- a leftover staging folder goes.

Nothing is changed while a DVC command holds the repository lock or runs a stage (its rwlock
names a live process writing an output).
"""

import configparser
import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.data.shards import SHARD_GLOB, Manifest
from dflash_pipeline.drafters.checkpoints import (
    INFO_FILE,
    KEEP_STATES,
    STATE_FOLDER,
    WEIGHTS_FILE,
    read_checkpoint_info,
    resume_state_problem,
    state_path,
    step_folder,
    weights_problem,
)
from dflash_pipeline.drafters.serving import PROVENANCE_FILE, provenance_problems
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import digest_problem, file_digest, read_json, recorded_digest_problem, staging_dir
from dflash_pipeline.foundation.tensor_files import safetensors_header

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


def _steps(checkpoints: Path) -> list[Path]:
    return sorted(path for path in checkpoints.glob("step_*") if path.is_dir() and path.name[5:].isdigit())


def check_checkpoints(checkpoints: Path) -> list[Finding]:
    """Every step folder: checkpoint.json readable, the weights and the resume state matching the
    digests it records (a checkpoint from before digests: its weights must at least parse)."""
    findings = []
    for folder in _steps(checkpoints):
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


def dvc_cache_dir(root: Path) -> Path | None:
    """The DVC cache folder of the repository at `root` (`cache.dir` of .dvc/config or
    config.local, else .dvc/cache), or None outside a DVC repository."""
    dvc_dir = Path(root) / ".dvc"
    if not dvc_dir.is_dir():
        return None
    cache = dvc_dir / "cache"
    for name in ("config", "config.local"):
        parser = configparser.ConfigParser()
        with contextlib.suppress(configparser.Error, OSError):
            parser.read(dvc_dir / name)
            if parser.has_option("cache", "dir"):
                cache = dvc_dir / parser.get("cache", "dir").strip().strip("'\"")  # relative to .dvc/ (an absolute one wins)
    return cache


def _object_path(cache: Path, md5: str) -> Path:
    return cache / "files" / "md5" / md5[:2] / md5[2:]


def _md5(path: Path) -> str:
    return file_digest(path, "md5")


def lock_objects(root: Path, cache: Path) -> dict[Path, list[Path]]:
    """Cache object -> the workspace files it holds, for every output dvc.lock records (DVC 3's
    `hash: md5` entries; a folder's `.dir` object lists its files)."""
    import yaml

    lock_file = Path(root) / "dvc.lock"
    if not lock_file.is_file():
        return {}
    try:
        lock = yaml.safe_load(lock_file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise PipelineError(f"{lock_file}: not valid YAML ({' '.join(str(exc).split())})") from None
    objects: dict[Path, list[Path]] = {}
    for stage in (lock.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            md5 = out.get("md5")
            if out.get("hash") != "md5" or not md5:
                continue  # DVC 2's md5-dos2unix objects are not verified here
            path = Path(root) / out["path"]
            objects.setdefault(_object_path(cache, md5), []).append(path)
            if md5.endswith(".dir"):
                listing = _object_path(cache, md5)
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):  # a damaged listing: check_cache names it
                    for entry in json.loads(listing.read_text(encoding="utf-8")):
                        objects.setdefault(_object_path(cache, entry["md5"]), []).append(path / entry["relpath"])
    return objects


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
        actual = _md5(obj)
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


# ----------------------------------------------------------------------------- repair


def _running_writers(dvc_tmp: Path) -> list[str]:
    """Outputs a live process is writing, from DVC's rwlock (DVC releases the repository lock while
    a stage's command runs, and keeps this record of what it writes)."""
    try:
        writers = json.loads((dvc_tmp / "rwlock").read_text(encoding="utf-8")).get("write") or {}
    except (OSError, ValueError, AttributeError):
        return []
    running = []
    for path, info in writers.items():
        with contextlib.suppress(OSError, TypeError, KeyError, ProcessLookupError):
            os.kill(int(info["pid"]), 0)
            running.append(f"{path} (pid {info['pid']})")
    return running


@contextlib.contextmanager
def dvc_lock_held(root: Path):
    """Hold DVC's repository lock (.dvc/tmp/lock, which `dvc repro` takes) while repairing; refuse
    when a DVC command holds it or a stage it runs is writing an output."""
    import fcntl

    if not (Path(root) / ".dvc").is_dir():
        yield
        return
    dvc_tmp = Path(root) / ".dvc" / "tmp"
    dvc_tmp.mkdir(parents=True, exist_ok=True)
    with open(dvc_tmp / "lock", "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PipelineError(f"{dvc_tmp / 'lock'}: a DVC command is running in this repository; repair when it is done") from None
        try:
            running = _running_writers(dvc_tmp)
            if running:
                raise PipelineError(f"{dvc_tmp / 'rwlock'}: a DVC stage is writing {running[0]}; repair when it is done")
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _same_file_objects(cache: Path | None, paths: list[Path]) -> dict[Path, list[Path]]:
    """For each of `paths`, the cache objects that are the same inode (its hard links in the cache)."""
    wanted = {}
    for path in paths:
        with contextlib.suppress(OSError):
            status = path.stat()
            wanted.setdefault((status.st_dev, status.st_ino), []).append(path)
    found: dict[Path, list[Path]] = {path: [] for path in paths}
    if cache is None or not cache.is_dir() or not wanted:
        return found
    for folder, _, names in os.walk(cache):
        if Path(folder).name == "runs" or "runs" in Path(folder).relative_to(cache).parts:
            continue  # the run cache holds stage records, not outputs
        for name in names:
            obj = Path(folder) / name
            with contextlib.suppress(OSError):
                status = obj.lstat()
                for path in wanted.get((status.st_dev, status.st_ino), []):
                    found[path].append(obj)
    return found


def _removal_plan(paths: RunPaths, damaged: list[Path]) -> list[Path]:
    """What goes for `damaged` files: the file itself, or for a checkpoint's file its step folder,
    its resume state and every newer step's (train then continues as `where_train_continues` says)."""
    plan: list[Path] = []
    checkpoints = paths.checkpoints.resolve()
    for path in damaged:
        try:
            relative = path.resolve().relative_to(checkpoints)
        except ValueError:
            plan.append(path)
            continue
        name = relative.parts[0] if relative.parts[0] != STATE_FOLDER else relative.parts[-1].removesuffix(".pt")
        if not (name.startswith("step_") and name[5:].isdigit()):
            plan.append(path)
            continue
        step = int(name[5:])
        for folder in _steps(paths.checkpoints):
            if int(folder.name[5:]) >= step:
                plan.append(folder)
        for state in (paths.checkpoints / STATE_FOLDER).glob("step_*.pt"):
            if state.stem[5:].isdigit() and int(state.stem[5:]) >= step:
                plan.append(state)
    return list(dict.fromkeys(plan))


def where_train_continues(checkpoints: Path) -> str:
    """Where the next train run continues once steps were removed: the newest step left that has
    its resume state, or the start when none has (only the newest KEEP_STATES steps keep one)."""
    states = {path.stem for path in (checkpoints / STATE_FOLDER).glob("step_*.pt")}
    resumable = [folder for folder in _steps(checkpoints) if folder.name in states]
    if resumable:
        return f"train continues from {resumable[-1].name}, the newest step left with its resume state"
    return (f"train starts from step 0: no step left has its resume state (only the newest {KEEP_STATES} steps keep one)"
            if _steps(checkpoints) else "train starts from step 0: no step is left")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path, 0o600)  # DVC's cache and its links are read-only; the folder is ours
        path.unlink(missing_ok=True)


def repair(paths: RunPaths, findings: list[Finding]) -> list[str]:
    """Act on `findings` (module docstring) and return one line per thing done."""
    cache = dvc_cache_dir(paths.root)
    done: list[str] = []
    with dvc_lock_held(paths.root):
        damaged = [f.path for f in findings if f.kind == "damaged"]
        for finding in (f for f in findings if f.kind == "cache"):
            objects_inode = finding.path.stat()
            same = [out for out in finding.backs if out.is_file() and (out.stat().st_dev, out.stat().st_ino)
                    == (objects_inode.st_dev, objects_inode.st_ino)]
            damaged += [out for out in same if out not in damaged]  # one inode: the output is damaged too
            good = next((out for out in finding.backs if out.is_file() and out not in same
                         and _md5(out) == finding.path.parent.name + finding.path.name.removesuffix(".dir")), None)
            if good is not None:
                tmp = finding.path.with_name(finding.path.name + ".repair")
                shutil.copyfile(good, tmp)
                os.chmod(tmp, 0o444)
                os.replace(tmp, finding.path)
                done.append(f"restored DVC cache object {finding.path} from its good copy {good}")
            elif not same:
                _remove(finding.path)
                done.append(f"removed damaged DVC cache object {finding.path}")
        plan = _removal_plan(paths, damaged)
        linked = _same_file_objects(cache, [file for file in damaged if file.is_file()])
        for file, objects in linked.items():
            for obj in objects:
                _remove(obj)
                done.append(f"removed DVC cache object {obj} (the same file as damaged {file})")
        for path in plan:
            if path.exists():
                holds_damage = any(path == file or path in file.parents for file in damaged)
                _remove(path)
                done.append(f"removed {path}" + (" (damaged)" if holds_damage else " (of or after a damaged step: train writes it again)"))
        if any(path.resolve().is_relative_to(paths.checkpoints.resolve()) for path in plan):
            done.append(where_train_continues(paths.checkpoints))
        for finding in (f for f in findings if f.kind == "leftover"):
            _remove(finding.path)
            done.append(f"removed leftover {finding.path}")
    return done
