"""Small file helpers every stage shares: atomic writes (a file appears whole or not at all),
content hashing and digest checks, strict JSON and figures. A killed stage leaves at most a `*.tmp`
file behind, never a half-written output.

A value that does not exist (a slot no block reached, the interval of a single prompt: NaN or
infinite in memory, `undefined`) has one spelling per format, all decided here and in
`stats.format_interval`: null in JSON, an empty cell in CSV, `n/a` on the console. Every JSON file
the pipeline writes goes through `json_text` (and so `write_json_atomic`): strict JSON, never NaN
or Infinity, which strict readers (DVC's metrics diff among them in some versions, jq, JavaScript)
reject. Every CSV file goes through `write_csv_atomic`, whose cells are `csv_cell`s: pandas and
`dvc plots` read an empty cell as missing, but a bare `inf` as a number. Figures are drawn with
matplotlib's Agg backend, so plots need no browser and no network.

A file a later stage trusts carries its sha256 in the JSON beside it (checkpoint.json, a shard
manifest, target.json, an export's dflash_pipeline.json), or, for a file with no such JSON (the
generate stage's Parquet files, evaluate's best.json), in a `<name>.sha256` record beside it in
`sha256sum -c` format, written before the file is renamed into place (`write_sha256_record`).
`digest_problem` is the one check of such a record, and a record without a digest (a file written
before there were any) has nothing to check.
"""

import contextlib
import hashlib
import json
import math
import numbers
import os
import shutil
from pathlib import Path


STAGING_SUFFIX = ".partial"


def staging_dir(out_dir: Path) -> Path:
    """Where a stage that publishes a folder in one rename works until it is done (capture): a
    killed run's work waits there for the rerun. Once the output exists it is a leftover, which
    `dflash-pipeline verify --repair` (run by `make repro`) removes, whatever served the output."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + STAGING_SUFFIX)


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def json_text(data, *, sort_keys: bool = True, ensure_ascii: bool = True) -> str:
    """`data` as strict JSON text (`strict_json`: NaN and infinities become null), two-space
    indented, with a final newline: the one way the pipeline spells a JSON file."""
    return json.dumps(strict_json(data), indent=2, sort_keys=sort_keys, ensure_ascii=ensure_ascii, allow_nan=False) + "\n"


def write_json_atomic(path: Path, data, *, sort_keys: bool = True) -> None:
    write_text_atomic(path, json_text(data, sort_keys=sort_keys))


def undefined(value) -> bool:
    """Whether `value` is a number that does not exist: None, NaN or an infinity (the interval of
    one prompt, a slot no block reached). Text, flags and finite numbers are defined."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return not math.isfinite(float(value))


def csv_cell(value):
    """`value` as a CSV cell: an undefined number is an empty cell, anything else is written as is."""
    return "" if undefined(value) else value


def write_csv_atomic(path: Path, columns: list[str], rows: list[dict]) -> None:
    """A CSV file with the header `columns` and one line per row (a key a row lacks: an empty
    cell), every cell a `csv_cell`; written atomically: the one way the pipeline spells a CSV file."""
    import csv

    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows([csv_cell(row.get(column)) for column in columns] for row in rows)


def file_digest(path: Path, algorithm: str = "sha256", chunk: int = 8 << 20) -> str:
    """The hex digest of a file's bytes, read in chunks (sha256 for our records, md5 for DVC's cache names)."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    return file_digest(path, "sha256", chunk)


# Digests already computed in this process, by (path, device, inode, size, mtime, ctime): a
# target's weights are checked wherever target.json is opened, hashed once per process. The ctime
# is in the key because a write that restores the mtime (as a flipped bit leaves it) cannot
# restore the ctime.
_DIGESTS: dict = {}


def sha256_file_cached(path: Path) -> str:
    """`sha256_file`, remembered for the process while the file's inode, size, mtime and ctime stay."""
    status = os.stat(path)
    key = (str(Path(path).resolve()), status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]


def digest_problem(path: Path, expected: str | None, *, recorded_in: Path | str, cached: bool = False) -> str | None:
    """What is wrong with `path` against the sha256 `expected` that `recorded_in` holds, as the one
    line a user sees, or None when it matches or nothing was recorded (a file from before digests)."""
    if not expected:
        return None
    path = Path(path)
    if not path.is_file():
        return f"{path}: missing ({Path(recorded_in).name} records its sha256)"
    actual = (sha256_file_cached if cached else sha256_file)(path)
    if actual != expected:
        return f"{path}: damaged (sha256 {actual[:12]}..., {Path(recorded_in).name} records {expected[:12]}...)"
    return None


SHA256_SUFFIX = ".sha256"


def sha256_record_path(path: Path) -> Path:
    """Where the `.sha256` record of `path` lies: beside it, its name plus `.sha256`."""
    return Path(path).with_name(Path(path).name + SHA256_SUFFIX)


def write_sha256_record(path: Path, digest: str) -> None:
    """Record `digest` as the sha256 of `path` (atomically, `sha256sum -c` format); a writer calls
    it before renaming the file into place, so a visible file always has its record."""
    write_text_atomic(sha256_record_path(path), f"{digest}  {Path(path).name}\n")


def write_json_recorded(path: Path, data) -> None:
    """A JSON file (`json_text`, atomic) with its `.sha256` record, written first: for a small
    record a later stage acts on that has no JSON beside it to hold its digest (best.json)."""
    text = json_text(data)
    write_sha256_record(path, hashlib.sha256(text.encode("utf-8")).hexdigest())
    write_text_atomic(path, text)


def recorded_sha256(path: Path) -> str | None:
    """The sha256 its writer recorded beside `path`, or None when there is no readable record."""
    try:
        digest = sha256_record_path(path).read_text(encoding="ascii").split(maxsplit=1)[0]
    except (FileNotFoundError, UnicodeDecodeError, IndexError):
        return None
    return digest if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) else None


def recorded_digest_problem(path: Path) -> str | None:
    """What is wrong with `path` against its `.sha256` record, as one line, or None when it matches
    or there is no record (a file from before records). A record that is there but unreadable (a
    flipped bit in it) is a problem too: nothing it vouches for can be trusted."""
    record = sha256_record_path(path)
    if not record.is_file():
        return None
    expected = recorded_sha256(path)
    if expected is None:
        return f"{path}: its sha256 record {record.name} is unreadable (damaged)"
    return digest_problem(path, expected, recorded_in=record)


def check_recorded_digest(path: Path) -> None:
    """Refuse `path` in one line when it does not match its `.sha256` record (`recorded_digest_problem`)."""
    from dflash_pipeline.foundation.errors import PipelineError

    problem = recorded_digest_problem(path)
    if problem:
        raise PipelineError(f"{problem}; `dflash-pipeline verify --repair`, then `dvc repro` (README, Recovery)")


def reuse_or_reset(folder: Path, record_name: str, record: dict, counted: str) -> int:
    """Prepare a resumable output folder: keep its contents only if `record_name` in it equals
    `record` (the settings they were made with), else empty it. Returns how many `counted`-glob
    files were discarded. Leftover `*.tmp` files of killed writers are removed either way."""
    folder = Path(folder)
    record_path = folder / record_name
    discarded = 0
    if folder.is_dir():
        try:
            previous = json.loads(record_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            previous = None
        if previous != record:
            discarded = len(list(folder.glob(counted)))
            shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob("*.tmp"):
        leftover.unlink()
    if not record_path.is_file():
        write_json_atomic(record_path, record)
    return discarded


def read_json(path: Path, *, missing: str):
    """Parse a JSON file; a missing or malformed file is one PipelineError line naming it."""
    from dflash_pipeline.foundation.errors import PipelineError

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{path}: {missing}") from None
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{path}: not valid JSON ({exc.msg})") from None


@contextlib.contextmanager
def atomic_path(path: Path):
    """Yield a temporary path beside `path`; on success it replaces `path` in one rename, on
    failure it is removed. For writers that want a path (pandas, matplotlib, csv)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp" + path.suffix)  # keep the suffix: matplotlib picks the format by it
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def format_bytes(count: float) -> str:
    """A byte count for people: 1.5 MB, 3.0 GB (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1024 or unit == "TB":
            return f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TB"


def strict_json(value):
    """`value` with every NaN or infinite number replaced by None (JSON null) and numpy scalars by
    Python numbers, recursively through dicts, lists and tuples."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return None if undefined(value) else float(value)
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def write_metrics(path: Path, metrics) -> None:
    """A metrics JSON file (strict JSON, atomic, sorted keys), its folder created if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, metrics)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path) -> None:
    """Lay out, write atomically (the format from the suffix) and close a matplotlib figure."""
    plt = pyplot()
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=110)
    plt.close(figure)
