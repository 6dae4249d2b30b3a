"""Prompt files: formats, stable ids, hash splits, bad rows, and the committed default set."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.helpers import REPO_ROOT, SAMPLE_PROMPTS, write_jsonl

from dflash_pipeline.data.prompts import prompt_id, read_prompts, split_of
from dflash_pipeline.foundation.errors import PipelineError


def test_three_row_formats_become_the_same_conversation(tmp_path):
    rows = [
        {"prompt": "Hi there"},
        {"messages": [{"role": "user", "content": "Hi there"}]},
        {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    prompt_set = read_prompts(path, val_fraction=0.1)
    # The trailing assistant turn is dropped, so all three are one prompt (kept once).
    assert len(prompt_set.prompts) == 1 and prompt_set.duplicates == 2
    assert prompt_set.prompts[0].as_messages() == [{"role": "user", "content": "Hi there"}]


def test_ids_are_content_hashes_and_splits_do_not_move_when_prompts_are_added(tmp_path):
    small = read_prompts(write_jsonl(tmp_path / "a.jsonl", SAMPLE_PROMPTS), val_fraction=0.3)
    extra = [{"prompt": f"extra prompt {i}"} for i in range(200)]
    large = read_prompts(write_jsonl(tmp_path / "b.jsonl", extra + SAMPLE_PROMPTS[::-1]), val_fraction=0.3)
    large_by_id = {p.id: p for p in large.prompts}
    for prompt in small.prompts:
        assert large_by_id[prompt.id].split == prompt.split
    val_share = sum(p.split == "val" for p in large.prompts) / len(large.prompts)
    assert 0.2 < val_share < 0.4
    assert prompt_id((("user", "x"),)) == prompt_id((("user", "x"),)) != prompt_id((("user", "y"),))
    assert split_of("0" * 16, 0.1) == "val" and split_of("f" * 16, 0.1) == "train"


def test_pinned_split_wins_over_the_hash(tmp_path):
    rows = [{"prompt": f"pinned {i}", "split": "val"} for i in range(20)]
    prompt_set = read_prompts(write_jsonl(tmp_path / "p.jsonl", rows), val_fraction=0.0)
    assert all(p.split == "val" for p in prompt_set.prompts)


BAD_ROWS = [
    ('{"prompt": "ok"', "malformed JSON"),
    ('{"text": "no prompt field"}', "missing field"),
    ('{"prompt": "   "}', "'prompt' is empty"),
    ('{"prompt": 7}', "'prompt' is int"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "'messages[0].role' is 'robot'"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user turn"),
    ('["a", "list"]', "expected a JSON object"),
    ('{"prompt": "x", "split": "test"}', "'split' is 'test'"),
]


@pytest.mark.parametrize("bad, reason", BAD_ROWS)
def test_a_bad_row_stops_the_read_with_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + bad + "\n")
    with pytest.raises(PipelineError) as error:
        read_prompts(path, val_fraction=0.1)
    assert str(error.value).startswith(f"{path}:3: ") and reason in str(error.value)


def test_non_utf8_row_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(PipelineError, match=r"p\.jsonl:2: not UTF-8"):
        read_prompts(path, val_fraction=0.1)


def test_skip_mode_counts_bad_rows_and_keeps_good_ones(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"prompt": "good one"}), *[bad for bad, _ in BAD_ROWS], json.dumps({"prompt": "good two"})]
    path.write_text("\n".join(lines) + "\n")
    prompt_set = read_prompts(path, val_fraction=0.1, on_bad_row="skip")
    assert [p.messages[-1][1] for p in prompt_set.prompts] == ["good one", "good two"]
    assert sum(prompt_set.skipped.values()) == len(BAD_ROWS)


def test_parquet_prompt_files_are_read_like_jsonl(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "one", "category": "chat"}, {"prompt": "two", "category": "math"}]), path)
    prompt_set = read_prompts(path, val_fraction=0.1)
    assert [(p.messages[0][1], p.category) for p in prompt_set.prompts] == [("one", "chat"), ("two", "math")]
    jsonl = read_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "one"}, {"prompt": "two"}]), val_fraction=0.1)
    assert [p.id for p in prompt_set.prompts] == [p.id for p in jsonl.prompts]


def test_limit_and_missing_file(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", SAMPLE_PROMPTS)
    assert len(read_prompts(path, val_fraction=0.1, limit=3).prompts) == 3
    with pytest.raises(PipelineError, match="prompt file not found"):
        read_prompts(tmp_path / "nope.jsonl", val_fraction=0.1)


def test_the_committed_default_prompt_set():
    path = REPO_ROOT / "data" / "prompts" / "default.jsonl"
    prompt_set = read_prompts(path, val_fraction=0.1)
    prompts = prompt_set.prompts
    assert len(prompts) >= 2000 and prompt_set.duplicates == 0 and not prompt_set.skipped
    categories = {p.category for p in prompts}
    assert {"coding", "math", "explain", "chat"} <= categories
    val_text = " ".join(p.messages[-1][1].lower() for p in prompts if p.split == "val")
    for story_task in ("fizzbuzz", "binary search", "lru cache"):
        assert story_task in val_text
    # The default run uses a prefix of the file: it must hold every category and the story tasks.
    prefix = prompts[:256]
    assert {p.category for p in prefix} >= {"coding", "math", "explain", "chat"}
    assert all(any(t in p.messages[-1][1].lower() for p in prefix if p.split == "val") for t in ("fizzbuzz", "binary search", "lru cache"))
