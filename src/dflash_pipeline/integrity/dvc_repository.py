"""What verify reads of a DVC repository itself: its cache folder, the cache objects dvc.lock's
outputs name, the cache objects that are the same file as an output (a hard link), and DVC's
repository lock, held while repairing.
"""

import configparser
import contextlib
import json
import os
from pathlib import Path

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import file_digest


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


def file_md5(path: Path) -> str:
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


def same_file_objects(cache: Path | None, paths: list[Path]) -> dict[Path, list[Path]]:
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
