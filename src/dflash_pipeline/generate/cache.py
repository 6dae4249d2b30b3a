"""The generate stage's answer cache: what the cached answers were made with (`generation_settings`),
and the answers themselves in atomically written Parquet chunks, each with its sha256 record
(`AnswerCache`), shared by every torchrun rank of the stage. A chunk of other settings is discarded,
a damaged one answered again; `write_parquet_atomic` also writes the stage's split files."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.foundation.config import GenerateConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import (
    SHA256_SUFFIX,
    recorded_digest_problem,
    reuse_or_reset,
    sha256_file,
    sha256_record_path,
    write_sha256_record,
)
from dflash_pipeline.data.prompts import GENERATED_SCHEMA
from dflash_pipeline.target.load import TargetInfo


def generation_settings(config: GenerateConfig, target: TargetInfo, compute_dtype: str, engine: str) -> dict:
    """Everything that changes an answer; cached answers are reused only when this matches."""
    return {
        "target_fingerprint": target.fingerprint,
        "system_prompt": config.system_prompt,
        "enable_thinking": config.enable_thinking,
        "max_new_tokens": config.max_new_tokens,
        "compute_dtype": compute_dtype,
        "decoding": "greedy",
        "engine": engine,
    }


def write_parquet_atomic(table: pa.Table, path: Path) -> None:
    """`path` whole or not at all, its sha256 record written before it is renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    write_sha256_record(path, sha256_file(tmp))
    os.replace(tmp, path)


def rows_table(rows: list[dict], settings: dict) -> pa.Table:
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    return table.replace_schema_metadata({b"dflash.generation_settings": json.dumps(settings, sort_keys=True).encode()})


class AnswerCache:
    """The resume cache: answers keyed by prompt id, stored as atomically written Parquet chunks.

    Under torchrun every rank opens the one folder: rank 0 first (`maintain`: it discards chunks of
    other settings and damaged ones), the others after a barrier, only reading. Rank r of `world`
    names its new chunks with numbers r, r + world, ..., so ranks never race for a name."""

    def __init__(self, folder: Path, settings: dict, *, maintain: bool = True, rank: int = 0, world: int = 1):
        self.folder = folder
        self.settings = settings
        self.rank, self.world = rank, world
        self.rows: dict[str, dict] = {}
        self.chunks: list[Path] = []
        self.discarded, self.dropped = 0, []
        if maintain:
            self.discarded = reuse_or_reset(folder, "settings.json", settings, "chunk-*.parquet")
            self.dropped = self._drop_unverified_chunks()
        self.read_chunks()

    def read_chunks(self) -> None:
        """Read every chunk in the folder not read yet (after a barrier: the other ranks' answers)."""
        known = set(self.chunks)
        for chunk in sorted(self.folder.glob("chunk-*.parquet")):
            if chunk in known:
                continue
            try:
                table = pq.read_table(chunk)
            except Exception as exc:  # a chunk is only ever renamed into place whole
                raise PipelineError(f"{chunk}: unreadable answer chunk ({exc}); delete it to regenerate its answers") from None
            for row in table.to_pylist():
                self.rows[row["prompt_id"]] = row
            self.chunks.append(chunk)
        self.chunks.sort()

    def _drop_unverified_chunks(self) -> list[str]:
        """Remove every chunk that does not match the sha256 record its writer made (its answers
        are generated again) and every record left without its chunk; say so in one line."""
        dropped = []
        for chunk in sorted(self.folder.glob("chunk-*.parquet")):
            problem = recorded_digest_problem(chunk)
            if problem is None and not sha256_record_path(chunk).is_file():
                problem = f"{chunk}: no recorded sha256 to check it against"
            if problem:
                chunk.unlink()
                sha256_record_path(chunk).unlink(missing_ok=True)
                dropped.append(problem)
        for record in self.folder.glob("chunk-*.parquet" + SHA256_SUFFIX):
            if not record.with_name(record.name.removesuffix(SHA256_SUFFIX)).is_file():
                record.unlink()  # a writer killed before its rename, or a chunk removed by `verify --repair`
        if dropped:
            shown = "; ".join(dropped[:2]) + (f"; and {len(dropped) - 2} more" if len(dropped) > 2 else "")
            print(f"generate: answering again the prompts of {len(dropped)} chunk(s) that do not match their recorded sha256: {shown}")
        return dropped

    def add(self, rows: list[dict]) -> None:
        """Save one batch's rows as the lowest-numbered chunk not there: a chunk answered again
        after damage takes its old name (and, the same prompts answered alike, its old bytes)."""
        taken = {chunk.name for chunk in self.chunks}
        index = next(number for number in range(self.rank, (len(taken) + 1) * self.world + self.rank + 1, self.world)
                     if f"chunk-{number:05d}.parquet" not in taken)
        path = self.folder / f"chunk-{index:05d}.parquet"
        write_parquet_atomic(rows_table(rows, self.settings), path)
        self.chunks = sorted(self.chunks + [path])
        for row in rows:
            self.rows[row["prompt_id"]] = row
