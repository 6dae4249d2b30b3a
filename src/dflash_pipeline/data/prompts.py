"""Prompt sets: read a user's JSONL or Parquet file into checked, hashed, split conversations.

A row is one of
- `{"prompt": "..."}`: a single user turn;
- `{"messages": [{"role": "user", "content": "..."}, ...]}` (OpenAI style);
- `{"conversations": [{"from": "human", "value": "..."}, ...]}` (ShareGPT style);
optionally with `category` (coding, math, chat, ...) and `split` ("train" or "val", pins the row).
A trailing assistant turn is dropped: the target regenerates every answer itself.

Each prompt gets a stable id, the sha256 of its canonical messages, and goes to validation when
that hash falls under `val_fraction`; adding prompts to a file therefore never moves old ones
between splits. Bad rows stop the read with `file:line: reason`, or are skipped and counted.

Also the table the `generate` stage writes from a prompt set (`GENERATED_SCHEMA`, `read_generated`):
the exact prompt and answer token ids every later stage reads.
"""

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import check_recorded_digest

ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
SPLITS = ("train", "val")
# The id is a prefix of the sha256; 16 hex digits make a collision among a million prompts ~1e-8.
ID_HEX_DIGITS = 16


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, ending with a user turn
    category: str
    split: str
    source_line: int

    def as_messages(self) -> list[dict]:
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass
class PromptSet:
    prompts: list[Prompt]
    skipped: Counter = field(default_factory=Counter)  # reason -> rows skipped
    duplicates: int = 0
    source: str = ""  # the prompt file read, named in errors about the set as a whole


class BadRow(ValueError):
    """A row that cannot become a prompt; the message is the reason."""


def prompt_id(messages: tuple[tuple[str, str], ...]) -> str:
    canonical = json.dumps([[role, content] for role, content in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:ID_HEX_DIGITS]


def split_of(pid: str, val_fraction: float) -> str:
    """Validation when the id's hash, read as a number in [0, 1), falls under val_fraction."""
    return "val" if int(pid, 16) / 16**ID_HEX_DIGITS < val_fraction else "train"


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise BadRow(f"{what} is {type(value).__name__}, expected a string")
    if not value.strip():
        raise BadRow(f"{what} is empty")
    return value


def _messages_of(row: dict) -> tuple[tuple[str, str], ...]:
    if "prompt" in row:
        return (("user", _text(row["prompt"], "'prompt'")),)
    if "messages" in row:
        turns, role_key, content_key, roles = row["messages"], "role", "content", {r: r for r in ROLES}
        name = "messages"
    elif "conversations" in row:
        turns, role_key, content_key, roles = row["conversations"], "from", "value", SHAREGPT_ROLES
        name = "conversations"
    else:
        raise BadRow("missing field: expected 'prompt', 'messages' or 'conversations'")
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"'{name}' must be a non-empty list")
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise BadRow(f"'{name}[{index}]' needs '{role_key}' and '{content_key}'")
        role = roles.get(turn[role_key]) if isinstance(turn[role_key], str) else None
        if role is None:
            raise BadRow(f"'{name}[{index}].{role_key}' is {turn[role_key]!r}, not one of {sorted(roles)}")
        messages.append((role, _text(turn[content_key], f"'{name}[{index}].{content_key}'")))
    while messages and messages[-1][0] == "assistant":
        messages.pop()
    if not messages or messages[-1][0] != "user":
        raise BadRow(f"'{name}' has no user turn to answer")
    return tuple(messages)


def parse_row(row: object, *, line: int, val_fraction: float) -> Prompt:
    if not isinstance(row, dict):
        raise BadRow(f"row is {type(row).__name__}, expected a JSON object")
    messages = _messages_of(row)
    category = row.get("category") or "general"
    if not isinstance(category, str):
        raise BadRow(f"'category' is {type(category).__name__}, expected a string")
    pid = prompt_id(messages)
    split = row.get("split") or split_of(pid, val_fraction)
    if split not in SPLITS:
        raise BadRow(f"'split' is {split!r}, expected one of {list(SPLITS)}")
    return Prompt(id=pid, messages=messages, category=category, split=split, source_line=line)


def _jsonl_rows(path: Path):
    """Yield (line number, parsed object or BadRow) for each non-blank line."""
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield line_no, BadRow(f"not UTF-8 (byte {exc.start})")
                continue
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text)
            except json.JSONDecodeError as exc:
                yield line_no, BadRow(f"malformed JSON ({exc.msg} at column {exc.colno})")


def _parquet_rows(path: Path):
    """Yield (row number, dict) for each Parquet row; row numbers count from 1 like lines."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise PipelineError(f"{path}: not a readable Parquet file ({exc})") from None
    for index, row in enumerate(table.to_pylist(), start=1):
        yield index, row


def read_prompts(path: Path | str, *, val_fraction: float, on_bad_row: str = "error", limit: int = 0) -> PromptSet:
    """Read a prompt file; stop at `limit` good prompts (0: all). Duplicate prompts are kept once."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: prompt file not found")
    if path.suffix == ".parquet":
        rows = _parquet_rows(path)
    elif path.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path)
    else:
        raise PipelineError(f"{path}: unknown prompt file type {path.suffix!r} (expected .jsonl or .parquet)")
    result = PromptSet(prompts=[], source=str(path))
    seen: set[str] = set()
    for line, row in rows:
        try:
            if isinstance(row, BadRow):
                raise row
            prompt = parse_row(row, line=line, val_fraction=val_fraction)
        except BadRow as bad:
            if on_bad_row == "skip":
                result.skipped[str(bad).split(" (")[0]] += 1
                continue
            raise PipelineError(f"{path}:{line}: {bad}") from None
        if prompt.id in seen:
            result.duplicates += 1
            continue
        seen.add(prompt.id)
        result.prompts.append(prompt)
        if limit and len(result.prompts) >= limit:
            break
    if not result.prompts:
        raise PipelineError(f"{path}: no usable prompts")
    return result


# ----------------------------------------------------------------------------- generated answers


GENERATED_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("category", pa.string()),
        ("split", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("prompt_ids", pa.list_(pa.int32())),
        ("answer_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),  # "stop" (EOS generated) or "length" (max_new_tokens reached)
    ]
)


def read_generated(path: Path) -> pa.Table:
    """Read a train/val Parquet written by the `generate` stage, checking it against the sha256
    record generate wrote beside it (one line naming it when they differ; a file from before
    records has nothing to check) and its schema. Capture reads through here; evaluate checks
    val.parquet the same way (`files.check_recorded_digest`) before it reads it."""
    if Path(path).is_file():
        check_recorded_digest(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found; run the `generate` stage first") from None
    except Exception as exc:
        raise PipelineError(f"{path}: not a readable Parquet file ({exc})") from None
    if not table.schema.remove_metadata().equals(GENERATED_SCHEMA):
        raise PipelineError(f"{path}: schema differs from the generate stage's ({table.schema.names})")
    return table
