"""The capture path's GPU contract, checked on a CPU (issue #27): the zero-copy writer that hashes
while writing gives the bytes and digest of the element-by-element writer it replaced
(`tests/oracles/shard_writer.py`), and a capture batch reads nothing back per row."""

import hashlib

import numpy as np
import pytest
import torch
from oracles.shard_writer import ElementwiseShardWriter
from support.device_reads import DeviceReads

from dflash_pipeline.capture.forward import capture_batch, forward_batch
from dflash_pipeline.capture.plan import Sequence
from dflash_pipeline.data.shards import ShardWriter
from dflash_pipeline.foundation.files import recorded_sha256


def _sequences(rng, count, width, top_k):
    rows = []
    for number in range(count):
        length = int(rng.integers(1, 300))
        rows.append(dict(sequence_id=f"p{number}-{'x' * number}", input_ids=rng.integers(0, 49152, length).astype(np.int64),
                         loss_mask=rng.integers(0, 2, length).astype(np.int64), target_next=rng.integers(0, 49152, length),
                         features=torch.randn(length, width) * float(rng.uniform(0.1, 300)),
                         topk_ids=rng.integers(0, 49152, (length, top_k)) if top_k else None,
                         topk_logprobs=-rng.random((length, top_k)) * 10 if top_k else None))
    return rows


@pytest.mark.parametrize("feature_dtype,top_k", [("bf16", 0), ("bf16", 8), ("fp8_e4m3", 4)])
def test_the_zero_copy_writer_writes_the_same_bytes_and_digest(tmp_path, feature_dtype, top_k):
    rng = np.random.default_rng(len(feature_dtype) + top_k)
    rows = _sequences(rng, 12, 96, top_k)
    infos = {}
    for name, writer_class in (("new", ShardWriter), ("old", ElementwiseShardWriter)):
        (tmp_path / name).mkdir()
        writer = writer_class(tmp_path / name / "shard-00000.arrow", feature_dtype=feature_dtype, feature_width=96, top_k=top_k)
        for row in rows:
            writer.write(row["sequence_id"], row["input_ids"], row["loss_mask"], row["target_next"], row["features"],
                         row["topk_ids"], row["topk_logprobs"])
        infos[name] = writer.close()
    new, old = (tmp_path / name / "shard-00000.arrow" for name in ("new", "old"))
    assert new.read_bytes() == old.read_bytes()
    assert infos["new"] == infos["old"]
    assert infos["new"].sha256 == hashlib.sha256(new.read_bytes()).hexdigest() == recorded_sha256(new)


def test_an_aborted_writer_leaves_nothing(tmp_path):
    writer = ShardWriter(tmp_path / "shard-00000.arrow", feature_dtype="bf16", feature_width=4)
    writer.write("a", [1, 2], [0, 1], [2, 3], torch.ones(2, 4))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_capture_batch_reads_back_once_not_per_row_and_equals_its_rows(tiny_target):
    model, tap = tiny_target[0], tiny_target[1]
    if True:
        rng = np.random.default_rng(0)
        lengths = rng.integers(5, 40, 6)
        batch = [Sequence(f"s{i}", rng.integers(3, 400, n).tolist(), [0] * (n - 5) + [1] * 5) for i, n in enumerate(lengths)]
        with DeviceReads() as reads:
            captured = capture_batch(model, tap, batch, pad_id=0, top_k=4, feature_dtype="bf16")
        # One read per batch, and none per row or column: transformers' mask code checks once per
        # forward that the batch is not packed (masking_utils.find_packed_sequence_indices).
        assert reads.calls == ["__bool__"]
        rows = captured.rows()
        reference = forward_batch(model, tap, batch, pad_id=0, top_k=4)  # compute dtype, rounded by the writer
        for row, expected, sequence in zip(rows, reference, batch):
            assert row.features.dtype == torch.bfloat16 and row.features.shape[0] == len(sequence.input_ids)
            assert torch.equal(row.features, expected.features.to(torch.bfloat16))
            assert torch.equal(row.target_next, expected.target_next) and torch.equal(row.topk_ids, expected.topk_ids)
