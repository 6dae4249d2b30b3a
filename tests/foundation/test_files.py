"""files.py: atomic writes leave the old file or the new one, never half of either; a resumable
folder is kept only for the same record; JSON errors are one line naming the file."""

import json

import pytest
from support.helpers import flip_a_byte, strict_json_load

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import (
    atomic_path,
    csv_cell,
    digest_problem,
    format_bytes,
    json_text,
    read_json,
    reuse_or_reset,
    sha256_file,
    write_csv_atomic,
    write_json_atomic,
    write_text_atomic,
)


def test_atomic_writes_replace_the_file_and_leave_no_tmp(tmp_path):
    path = tmp_path / "out.json"
    write_text_atomic(path, "old")
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'  # sorted keys: byte-stable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_atomic_path_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "plot.png"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            assert tmp.suffix == ".png" and tmp != path  # the writer picks its format by the suffix
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    with atomic_path(path) as tmp:
        tmp.write_text("new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_sha256_file_reads_in_chunks_as_one_digest(tmp_path):
    import hashlib

    data = bytes(range(256)) * 1000
    (tmp_path / "blob").write_bytes(data)
    assert sha256_file(tmp_path / "blob", chunk=1000) == sha256_file(tmp_path / "blob") == hashlib.sha256(data).hexdigest()


def test_reuse_or_reset_keeps_a_folder_of_the_same_record_only(tmp_path):
    folder = tmp_path / "chunks"
    assert reuse_or_reset(folder, "record.json", {"seed": 0}, "chunk-*") == 0
    (folder / "chunk-0").write_text("done")
    (folder / "chunk-1.tmp").write_text("killed writer")
    assert reuse_or_reset(folder, "record.json", {"seed": 0}, "chunk-*") == 0
    assert sorted(p.name for p in folder.iterdir()) == ["chunk-0", "record.json"]
    assert reuse_or_reset(folder, "record.json", {"seed": 1}, "chunk-*") == 1  # other settings: start over
    assert sorted(p.name for p in folder.iterdir()) == ["record.json"]
    assert json.loads((folder / "record.json").read_text()) == {"seed": 1}


def test_read_json_failures_are_one_line_naming_the_file(tmp_path):
    with pytest.raises(PipelineError, match=r"nope.json: no such run"):
        read_json(tmp_path / "nope.json", missing="no such run")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PipelineError, match=r"bad.json: not valid JSON \(") as caught:
        read_json(tmp_path / "bad.json", missing="-")
    assert "\n" not in str(caught.value)
    write_json_atomic(tmp_path / "good.json", {"step": 3})
    assert read_json(tmp_path / "good.json", missing="-") == {"step": 3}


@pytest.mark.parametrize("count, text", [(0, "0.0 B"), (1023, "1023.0 B"), (1536, "1.5 KB"), (3 * 1024**3, "3.0 GB"),
                                         (5 * 1024**5, "5120.0 TB")])
def test_format_bytes_in_powers_of_1024(count, text):
    assert format_bytes(count) == text


def test_every_json_file_is_strict_json_with_null_for_undefined_numbers(tmp_path):
    # The one writer: an interval over one prompt (inf) or a slot no block reached (nan) is null,
    # never a bare Infinity/NaN that jq, JavaScript and strict JSON readers refuse.
    data = {"tau_ci95": float("inf"), "slots": [0.5, float("nan")], "low": float("-inf"), "nested": {"x": (1, 2.5)}}
    write_json_atomic(tmp_path / "m.json", data)
    assert strict_json_load(tmp_path / "m.json") == {"tau_ci95": None, "slots": [0.5, None], "low": None, "nested": {"x": [1, 2.5]}}
    assert json_text({"b": 1, "a": float("nan")}, sort_keys=False) == '{\n  "b": 1,\n  "a": null\n}\n'


def test_every_csv_file_spells_an_undefined_number_as_an_empty_cell(tmp_path):
    # pandas and `dvc plots` read a bare `inf` as a number; an empty cell is a missing value, as null is in JSON.
    import numpy as np
    import pandas as pd

    rows = [{"step": 1, "tau": 1.5, "tau_ci95": float("inf"), "slot": np.float32("nan"), "name": "a"},
            {"step": 2, "tau": None, "tau_ci95": 0.25, "name": "n/a"}]  # the second row lacks "slot"
    write_csv_atomic(tmp_path / "c.csv", ["step", "tau", "tau_ci95", "slot", "name"], rows)
    assert (tmp_path / "c.csv").read_text() == "step,tau,tau_ci95,slot,name\n1,1.5,,,a\n2,,0.25,,n/a\n"
    frame = pd.read_csv(tmp_path / "c.csv", keep_default_na=False, na_values=[""])
    assert frame["tau_ci95"].isna().tolist() == [True, False] and not np.isinf(frame["tau_ci95"].fillna(0)).any()
    assert [csv_cell(value) for value in (float("-inf"), 0, 0.0, False, "x", np.int64(3))] == ["", 0, 0.0, False, "x", 3]
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_digest_names_the_damaged_or_missing_file_and_nothing_recorded_checks_nothing(tmp_path):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    digest = sha256_file(blob)
    assert digest_problem(blob, digest, recorded_in=tmp_path / "checkpoint.json") is None
    assert digest_problem(blob, None, recorded_in="checkpoint.json") is None  # a file from before digests
    flip_a_byte(blob)
    problem = digest_problem(blob, digest, recorded_in=tmp_path / "checkpoint.json")
    assert problem.startswith(f"{blob}: damaged (sha256 ") and problem.endswith(f"checkpoint.json records {digest[:12]}...)")
    blob.unlink()
    assert digest_problem(blob, digest, recorded_in="checkpoint.json") == f"{blob}: missing (checkpoint.json records its sha256)"
