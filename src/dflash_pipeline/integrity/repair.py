"""`dflash-pipeline verify --repair`: act on what `checks.check_run` found, so that DVC brings good
copies back.

With `cache.type hardlink` an output file and its cache object are one inode, and DVC trusts its
cache without rehashing: `dvc repro` then restores the damaged object from the run cache,
`dvc checkout --relink` links a rebuilt good file back to it, and `dvc pull` sees the object
present and fetches nothing. So `repair` removes what is
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

import contextlib
import os
import shutil
from pathlib import Path

from dflash_pipeline.drafters.checkpoints import KEEP_STATES, STATE_FOLDER
from dflash_pipeline.integrity.checks import Finding, RunPaths, step_folders
from dflash_pipeline.integrity.dvc_repository import (
    dvc_cache_dir,
    dvc_lock_held,
    file_md5,
    same_file_objects,
)


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
        for folder in step_folders(paths.checkpoints):
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
    resumable = [folder for folder in step_folders(checkpoints) if folder.name in states]
    if resumable:
        return f"train continues from {resumable[-1].name}, the newest step left with its resume state"
    return (f"train starts from step 0: no step left has its resume state (only the newest {KEEP_STATES} steps keep one)"
            if step_folders(checkpoints) else "train starts from step 0: no step is left")


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
                         and file_md5(out) == finding.path.parent.name + finding.path.name.removesuffix(".dir")), None)
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
        linked = same_file_objects(cache, [file for file in damaged if file.is_file()])
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
