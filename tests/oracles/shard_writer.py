"""The shard writer as it was before its columns were zero-copy and its digest was computed while
writing (commit 0121fa1): the reference the new `ShardWriter` must equal byte for byte
(tests/capture/test_gpu_contract.py)."""

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_pipeline.data.shards import ShardInfo, encode_features, shard_schema
from dflash_pipeline.foundation.files import sha256_record_path
from dflash_pipeline.foundation.files import sha256_file, write_text_atomic


class ElementwiseShardWriter:
    """The writer before zero-copy columns (commit 0121fa1): every column converted with `pa.array(values, type)`."""

    def __init__(self, path: Path, *, feature_dtype: str, feature_width: int, top_k: int = 0):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self.feature_dtype = feature_dtype
        self.feature_width = feature_width
        self.top_k = top_k
        self.schema = shard_schema(feature_dtype, feature_width, top_k)
        self._sink = pa.OSFile(str(self.tmp_path), "wb")
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self.sequences = 0
        self.tokens = 0

    def write(self, sequence_id: str, input_ids, loss_mask, target_next, features, topk_ids=None, topk_logprobs=None) -> None:
        """One sequence; `topk_ids` / `topk_logprobs` are [S, K] (None when K is 0)."""
        length = len(input_ids)
        if self.top_k == 0:
            topk_ids, topk_logprobs = np.zeros((length, 0), np.int32), np.zeros((length, 0), np.float32)
        topk_ids, topk_logprobs = np.asarray(topk_ids, dtype=np.int32), np.asarray(topk_logprobs, dtype=np.float32)
        if not (len(loss_mask) == len(target_next) == features.shape[0] == length) or features.shape[1] != self.feature_width \
                or topk_ids.shape != (length, self.top_k) or topk_logprobs.shape != (length, self.top_k):
            raise ValueError(
                f"sequence {sequence_id}: lengths disagree (ids {length}, mask {len(loss_mask)}, "
                f"next {len(target_next)}, features {tuple(features.shape)}, width {self.feature_width}, "
                f"top-k {topk_ids.shape} / {topk_logprobs.shape}, K {self.top_k})"
            )
        values, scales = encode_features(features, self.feature_dtype)
        value_type = pa.uint16() if self.feature_dtype == "bf16" else pa.uint8()
        columns = [
            pa.array([sequence_id], pa.string()),
            _list_array(np.asarray(input_ids, dtype=np.int32), pa.int32()),
            _list_array(np.asarray(loss_mask, dtype=np.uint8), pa.uint8()),
            _list_array(np.asarray(target_next, dtype=np.int32), pa.int32()),
            _list_array(topk_ids.reshape(-1), pa.int32()),
            _list_array(topk_logprobs.reshape(-1), pa.float32()),
            pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), pa.array(values, value_type)),
        ]
        if scales is not None:
            columns.append(_list_array(scales, pa.float32()))
        self._writer.write_batch(pa.record_batch(columns, schema=self.schema))
        self.sequences += 1
        self.tokens += length

    def close(self) -> ShardInfo:
        """Finish the file, record its sha256 beside it, then rename it into place: a visible
        shard always has the record a rerun checks it against."""
        self._writer.close()
        self._sink.close()
        with open(self.tmp_path, "rb") as handle:
            os.fsync(handle.fileno())
        digest = sha256_file(self.tmp_path)
        write_text_atomic(sha256_record_path(self.path), f"{digest}  {self.path.name}\n")
        os.replace(self.tmp_path, self.path)
        return ShardInfo(self.path.name, self.sequences, self.tokens, self.path.stat().st_size, digest)

    def abort(self) -> None:
        try:
            self._writer.close()
            self._sink.close()
        finally:
            self.tmp_path.unlink(missing_ok=True)


def _list_array(values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), pa.array(values, value_type))
