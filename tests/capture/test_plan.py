"""capture/plan.py: what is read from the generated answers (odd rows counted, not fatal) and how
the sequences are cut into shards and batches."""

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.capture.plan import Sequence, load_sequences, plan_shards
from dflash_pipeline.data.prompts import GENERATED_SCHEMA


def test_edge_cases_are_counted(tmp_path):
    rows = [
        {"prompt_ids": [5, 6], "answer_ids": []},  # empty answer
        {"prompt_ids": [5] * 10, "answer_ids": [7] * 10},  # truncated to 12: 2 answer tokens left
        {"prompt_ids": [5] * 14, "answer_ids": [7] * 3},  # no answer token within max_length
        {"prompt_ids": [], "answer_ids": [7, 8]},  # all-answer sequence
        {"prompt_ids": [1, 2], "answer_ids": [3]},
    ]
    table = pa.Table.from_pylist([{"prompt_id": str(i), "category": "c", "split": "train", "messages": [],
                                   "finish_reason": "stop", **row} for i, row in enumerate(rows)], schema=GENERATED_SCHEMA)
    pq.write_table(table, tmp_path / "train.parquet")
    sequences, stats = load_sequences(tmp_path / "train.parquet", max_length=12, on_too_long="truncate")
    assert [s.id for s in sequences] == ["1", "3", "4"]
    assert sequences[0].loss_mask == [0] * 10 + [1, 1]
    assert stats == {"rows": 5, "skipped_empty_answer": 1, "truncated": 2, "skipped_no_answer_within_max_length": 1, "all_answer_tokens": 1}
    sequences, stats = load_sequences(tmp_path / "train.parquet", max_length=12, on_too_long="skip")
    assert [s.id for s in sequences] == ["3", "4"] and stats["skipped_too_long"] == 2


def test_plan_batches_similar_lengths_and_respects_budgets():
    lengths = [50, 10, 30, 45, 12, 31, 29, 11]
    sequences = [Sequence(str(i), [1] * n, [1] * n) for i, n in enumerate(lengths)]
    plan = plan_shards(sequences, token_bytes=10, shard_bytes=1000, batch_tokens=100)
    flat = [i for shard in plan for batch in shard for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    for shard in plan:
        assert sum(lengths[i] for batch in shard for i in batch) * 10 <= 1000 or len(shard) == 1
        for batch in shard:
            assert len(batch) * max(lengths[i] for i in batch) <= 100 or len(batch) == 1
