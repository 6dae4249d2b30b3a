"""Captured target features on disk: the Arrow shard format, its writer, reader and verifier.

One concern: the shard format (its version below). The column layout, the feature encoding, the
writer, the zero-copy reader and the verifier must agree byte for byte and change together, so
they live in one module.

A split folder (`data/hidden/train/`) holds `shard-NNNNN.arrow` files and a `manifest.json`.
Each shard is an Arrow IPC *file* (random access through its footer, memory-mappable), and each
record batch in it is ONE sequence, so reading sample i is a footer lookup plus zero-copy views
of the mapped bytes, whatever the dataset's size. Columns per sequence of S tokens:

    sequence_id     string          the prompt id from `generate`
    input_ids       list<int32>     [S] prompt + answer token ids
    loss_mask       list<uint8>     [S] 1 on answer tokens
    target_next     list<int32>     [S] the target's greedy next token after each position
    target_topk_ids list<int32>     [S*K] the target's K most probable next tokens per position
    target_topk_logprobs list<float32> [S*K] their log-probabilities (full-vocabulary softmax)
    features        large_list<u16> [S*W] bf16 bit patterns, W = len(layer_ids) * hidden_size
                    large_list<u8>  [S*W] or fp8-e4m3 bit patterns ...
    feature_scales  list<float32>   [S]   ... with one scale per token (fp8 only)

bf16 is stored bit-exact as its 16-bit pattern; fp8-e4m3 halves the size with a per-token
absmax scale. A shard is written under a temporary name and renamed when complete, so a
visible shard is always whole. The manifest records the target fingerprint, layer ids, sizes,
counts and each shard's sha256; `open_split` checks all of it before training or evaluation.
K is `capture.target_top_k` (recorded in the schema and the manifest; 0 stores empty lists): the
target's distribution, not only its argmax, for distillation. Format version 2 added it; shards
of version 1 are refused with one line, never misread.

Until the manifest exists (a capture still running, or killed), each finished shard has its
sha256 beside it in `shard-NNNNN.arrow.sha256` (`sha256sum -c` format), written before the
shard is renamed into place: a rerun keeps a shard only when its bytes match a record its
writer made, never because it merely parses. Capture removes these files once the manifest,
which records the same hashes, is written.
"""

import hashlib
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import (  # the `.sha256` record helpers are re-exported: capture and tests use them from here
    SHA256_SUFFIX,
    read_json,
    recorded_sha256,
    sha256_file,
    sha256_record_path,
    write_json_atomic,
    write_sha256_record,
)

SHARD_FORMAT_VERSION = 2
FEATURE_DTYPES = ("bf16", "fp8_e4m3")
FP8_E4M3_MAX = 448.0
SHARD_GLOB = "shard-*.arrow"


def bytes_per_token(feature_width: int, feature_dtype: str, top_k: int = 0) -> int:
    """Payload bytes of one token: features, input id, target next token, loss mask, top-K."""
    feature_bytes = feature_width * 2 if feature_dtype == "bf16" else feature_width + 4  # fp8 + scale
    return feature_bytes + 4 + 4 + 1 + 8 * top_k


# Column positions inside a record batch (0 is the sequence id, a string).
INPUT_IDS, LOSS_MASK, TARGET_NEXT, TOPK_IDS, TOPK_LOGPROBS, FEATURES, FEATURE_SCALES = range(1, 8)


def shard_schema(feature_dtype: str, feature_width: int, top_k: int = 0) -> pa.Schema:
    if feature_dtype not in FEATURE_DTYPES:
        raise PipelineError(f"feature dtype {feature_dtype!r} is not one of {FEATURE_DTYPES}")
    fields = [
        ("sequence_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("target_next", pa.list_(pa.int32())),
        ("target_topk_ids", pa.list_(pa.int32())),
        ("target_topk_logprobs", pa.list_(pa.float32())),
        ("features", pa.large_list(pa.uint16() if feature_dtype == "bf16" else pa.uint8())),
    ]
    if feature_dtype == "fp8_e4m3":
        fields.append(("feature_scales", pa.list_(pa.float32())))
    metadata = {
        "dflash.shard_format_version": str(SHARD_FORMAT_VERSION),
        "dflash.feature_dtype": feature_dtype,
        "dflash.feature_width": str(feature_width),
        "dflash.target_top_k": str(top_k),
    }
    return pa.schema(fields, metadata=metadata)


def encode_features(features, feature_dtype: str):
    """[S, W] float tensor -> (flat numpy bit patterns, per-token scales or None)."""
    import torch

    if feature_dtype == "bf16":
        bits = features.to(torch.bfloat16).contiguous().view(torch.int16).reshape(-1)
        return bits.cpu().numpy().view(np.uint16), None
    values = features.float()
    scales = values.abs().amax(dim=-1).clamp(min=1e-12) / FP8_E4M3_MAX  # [S]
    quantised = (values / scales[:, None]).to(torch.float8_e4m3fn).contiguous().view(torch.uint8).reshape(-1)
    return quantised.cpu().numpy(), scales.cpu().numpy().astype(np.float32)


def decode_features(values: np.ndarray, scales: np.ndarray | None, width: int, feature_dtype: str):
    """Flat bit patterns -> [S, W] tensor: bf16 as a zero-copy view, fp8 dequantised to bf16."""
    import torch

    if feature_dtype == "bf16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16).view(-1, width)
    raw = torch.from_numpy(values).view(torch.float8_e4m3fn).view(-1, width)
    return (raw.float() * torch.from_numpy(scales)[:, None]).to(torch.bfloat16)


def round_as_stored(features, feature_dtype: str):
    """[S, W] float tensor -> what `decode_features(*encode_features(...))` gives, bit for bit, with
    torch ops on the tensor's own device and nothing copied to or from the host, so a captured CUDA
    graph can run it (the speculative step rounds live features this way)."""
    import torch

    if feature_dtype == "bf16":
        return features.to(torch.bfloat16)
    values = features.float()
    scales = values.abs().amax(dim=-1).clamp(min=1e-12) / FP8_E4M3_MAX  # float32, as encode_features stores them
    return ((values / scales[:, None]).to(torch.float8_e4m3fn).float() * scales[:, None]).to(torch.bfloat16)


@dataclass
class Sample:
    """One captured sequence. Tensors may be views of a memory-mapped shard: copy to keep them."""

    sequence_id: str
    input_ids: "object"  # torch.LongTensor-compatible int32 tensor [S]
    loss_mask: "object"  # uint8 tensor [S]
    target_next: "object"  # int32 tensor [S]
    features: "object"  # bf16 tensor [S, W]
    target_topk_ids: "object" = None  # int32 tensor [S, K]
    target_topk_logprobs: "object" = None  # float32 tensor [S, K]


@dataclass
class ShardInfo:
    file: str
    sequences: int
    tokens: int
    bytes: int
    sha256: str


class _HashingFile:
    """A binary file that hashes what is written to it: the shard's sha256 is known when the last
    byte is written, with no second read of the file."""

    def __init__(self, path: Path):
        self._file = open(path, "wb")
        self.digest = hashlib.sha256()
        self._position = 0
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)  # releases the GIL on large buffers
        self._file.write(view)
        self._position += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._position

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._file.flush()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self.closed:
            self._file.close()
            self.closed = True


class ShardWriter:
    """Write sequences into one shard; the file appears under its final name only on `close()`.

    Columns are handed to Arrow as zero-copy views of numpy arrays that already have the
    column's type (converting element by element ran at ~190 MiB/s, several times the rest of
    the write), and the file is hashed as it is written."""

    def __init__(self, path: Path, *, feature_dtype: str, feature_width: int, top_k: int = 0):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self.feature_dtype = feature_dtype
        self.feature_width = feature_width
        self.top_k = top_k
        self.schema = shard_schema(feature_dtype, feature_width, top_k)
        self._file = _HashingFile(self.tmp_path)
        self._sink = pa.PythonFile(self._file, mode="w")
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
        columns = [
            pa.array([sequence_id], pa.string()),
            _list_array(np.asarray(input_ids, dtype=np.int32)),
            _list_array(np.asarray(loss_mask, dtype=np.uint8)),
            _list_array(np.asarray(target_next, dtype=np.int32)),
            _list_array(topk_ids.reshape(-1)),
            _list_array(topk_logprobs.reshape(-1)),
            pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), _zero_copy(values)),
        ]
        if scales is not None:
            columns.append(_list_array(scales))
        self._writer.write_batch(pa.record_batch(columns, schema=self.schema))
        self.sequences += 1
        self.tokens += length

    def close(self) -> ShardInfo:
        """Finish the file, record its sha256 beside it, then rename it into place: a visible
        shard always has the record a rerun checks it against."""
        self._writer.close()
        self._file.sync()
        self._sink.close()
        self._file.close()
        digest = self._file.digest.hexdigest()
        write_sha256_record(self.path, digest)
        os.replace(self.tmp_path, self.path)
        return ShardInfo(self.path.name, self.sequences, self.tokens, self.path.stat().st_size, digest)

    def abort(self) -> None:
        try:
            self._writer.close()
            self._sink.close()
            self._file.close()
        finally:
            self.tmp_path.unlink(missing_ok=True)


def _zero_copy(values: np.ndarray) -> pa.Array:
    """A numpy array as an Arrow array of its own type, sharing its memory (no conversion)."""
    return pa.array(np.ascontiguousarray(values))


def _list_array(values: np.ndarray) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), _zero_copy(values))


@dataclass
class Manifest:
    """What a split folder holds; written last, after every shard is complete."""

    split: str
    target_fingerprint: str
    layer_ids: list[int]
    hidden_size: int
    num_target_layers: int
    feature_dtype: str
    feature_width: int
    sequences: int
    tokens: int
    loss_tokens: int
    shards: list[ShardInfo]
    stats: dict = field(default_factory=dict)
    target_top_k: int = 0
    format_version: int = SHARD_FORMAT_VERSION

    def save(self, folder: Path) -> None:
        write_json_atomic(Path(folder) / "manifest.json", asdict(self))

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        path = Path(folder) / "manifest.json"
        data = read_json(path, missing="no manifest; run the `capture` stage first (dvc repro capture)")
        if data.get("format_version") != SHARD_FORMAT_VERSION:
            raise PipelineError(f"{path}: shard format_version {data.get('format_version')!r}, this code reads only "
                                f"{SHARD_FORMAT_VERSION}; recapture (dvc repro capture)")
        try:
            data["shards"] = [ShardInfo(**s) for s in data["shards"]]
            return cls(**data)
        except TypeError as exc:
            raise PipelineError(f"{path}: fields do not match the manifest format ({exc})") from None


class ShardDataset:
    """Random access to every sequence of a split folder through memory-mapped shards.

    Opening reads the manifest only, and a shard's footer is read when one of its samples is
    first asked for: the time to the first sample does not grow with the dataset. `verify="full"` (the default for train and evaluate) also checks
    every shard's size, sha256, schema and row lengths against the manifest first.
    """

    def __init__(self, folder: Path, *, expected_fingerprint: str | None = None, verify: str = "full"):
        self.folder = Path(folder)
        self.manifest = Manifest.load(self.folder)
        if expected_fingerprint is not None and self.manifest.target_fingerprint != expected_fingerprint:
            raise PipelineError(
                f"{self.folder / 'manifest.json'}: captured from target {self.manifest.target_fingerprint[:12]}, "
                f"but the current target is {expected_fingerprint[:12]}; rerun capture (dvc repro capture)"
            )
        if verify not in ("full", "none"):
            raise ValueError(f"verify must be 'full' or 'none', not {verify!r}")
        if verify == "full":
            verify_split(self.folder, self.manifest)
        # Samples are read-only views of the read-only mapping; torch warns about that on every
        # from_numpy, and the data is never written through them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self._readers: dict[int, object] = {}  # opened on first use: opening costs no data reads
        self._index: list[tuple[int, int]] = []  # sample -> (shard, record batch)
        for shard_number, info in enumerate(self.manifest.shards):
            self._index.extend((shard_number, batch) for batch in range(info.sequences))
        self.width = self.manifest.feature_width
        self.dtype = self.manifest.feature_dtype
        self.top_k = self.manifest.target_top_k

    def _shard(self, shard_number: int) -> "_MappedShard":
        shard = self._readers.get(shard_number)
        if shard is None:
            info = self.manifest.shards[shard_number]
            shard = _MappedShard(self.folder / info.file, info.sequences)
            self._readers[shard_number] = shard
        return shard

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> Sample:
        import torch

        shard_number, row = self._index[index]
        shard = self._shard(shard_number)
        sequence_id, columns = shard.row(row)
        def column(number):  # `columns` leaves out the sequence id
            return shard.view(*columns[number - 1])

        scales = column(FEATURE_SCALES) if self.dtype == "fp8_e4m3" else None
        return Sample(
            sequence_id=sequence_id,
            input_ids=torch.from_numpy(column(INPUT_IDS)),
            loss_mask=torch.from_numpy(column(LOSS_MASK)),
            target_next=torch.from_numpy(column(TARGET_NEXT)),
            features=decode_features(column(FEATURES), scales, self.width, self.dtype),
            target_topk_ids=self._per_token(torch.from_numpy(column(TOPK_IDS)), len(column(INPUT_IDS))),
            target_topk_logprobs=self._per_token(torch.from_numpy(column(TOPK_LOGPROBS)), len(column(INPUT_IDS))),
        )

    def _per_token(self, flat, length: int):
        return flat.view(length, self.top_k)

    def lengths(self) -> list[int]:
        """Tokens per sample, without touching the features (for length-aware batching)."""
        return [self._shard(shard).row(row)[1][0][1] for shard, row in self._index]


class _MappedShard:
    """One memory-mapped shard and, per sequence, where each column's values lie in the file.

    A sequence's layout is read from its record batch's metadata the first time it is asked
    for (microseconds) and kept; after that the sample is numpy views at known offsets.
    """

    def __init__(self, path: Path, sequences: int):
        try:
            mapped = pa.memory_map(str(path), "r")
            reader = pa.ipc.open_file(mapped)
        except (OSError, pa.ArrowInvalid) as exc:
            raise PipelineError(f"{path}: not a readable Arrow shard ({exc})") from None
        if reader.num_record_batches != sequences:
            raise PipelineError(f"{path}: {reader.num_record_batches} sequences, manifest says {sequences}")
        mapped.seek(0)
        whole = mapped.read_buffer()  # zero-copy: the whole mapping as one buffer
        self.bytes = np.frombuffer(whole, dtype=np.uint8)
        self._base = whole.address
        self._reader = reader
        self._rows: list = [None] * sequences
        self._mapped = mapped

    def row(self, number: int):
        """(sequence id, [(byte offset, count, type) for each list column]) of one sequence."""
        layout = self._rows[number]
        if layout is None:
            batch = self._reader.get_batch(number)
            columns = []
            for column in range(1, batch.num_columns):
                values = batch.column(column).values
                data = values.buffers()[1]
                # An empty list (top-k with K = 0) may have no data buffer at all.
                offset = data.address - self._base + values.offset * _ITEM_BYTES[values.type] if len(values) else 0
                columns.append((offset, len(values), values.type))
            layout = self._rows[number] = (batch.column(0)[0].as_py(), columns)
        return layout

    def view(self, offset: int, count: int, value_type) -> np.ndarray:
        item = _ITEM_BYTES[value_type]
        return self.bytes[offset : offset + count * item].view(_NUMPY_TYPES[value_type])


_ITEM_BYTES = {pa.int32(): 4, pa.uint8(): 1, pa.uint16(): 2, pa.float32(): 4}
_NUMPY_TYPES = {pa.int32(): np.int32, pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.float32(): np.float32}


def _row_values(batch: pa.RecordBatch, column: int) -> np.ndarray:
    """The values of a one-row list column as a zero-copy, read-only numpy view.

    Our writer gives every record batch a single row whose list starts at offset 0, so the
    column's value buffer is exactly that row (verify_split checks the lengths).
    """
    return batch.column(column).values.to_numpy(zero_copy_only=True)


def verify_split(folder: Path, manifest: Manifest | None = None) -> Manifest:
    """Check every shard against the manifest; the first problem stops with a one-line error."""
    folder = Path(folder)
    manifest = manifest or Manifest.load(folder)
    expected_schema = shard_schema(manifest.feature_dtype, manifest.feature_width, manifest.target_top_k)
    listed = {info.file for info in manifest.shards}
    for extra in sorted(p.name for p in folder.glob(SHARD_GLOB)):
        if extra not in listed:
            raise PipelineError(f"{folder / extra}: shard not listed in the manifest (foreign or left from another run)")
    sequences = tokens = 0
    for info in manifest.shards:
        path = folder / info.file
        if not path.is_file():
            raise PipelineError(f"{path}: shard listed in the manifest is missing")
        size = path.stat().st_size
        if size != info.bytes:
            raise PipelineError(f"{path}: {size} bytes, manifest says {info.bytes} (truncated or replaced)")
        if sha256_file(path) != info.sha256:
            raise PipelineError(f"{path}: sha256 differs from the manifest (corrupt shard)")
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        except (OSError, pa.ArrowInvalid) as exc:
            raise PipelineError(f"{path}: not a readable Arrow shard ({exc})") from None
        if not reader.schema.equals(expected_schema, check_metadata=True):
            raise PipelineError(f"{path}: schema differs from the manifest's {manifest.feature_dtype} x {manifest.feature_width} format")
        if reader.num_record_batches != info.sequences:
            raise PipelineError(f"{path}: {reader.num_record_batches} sequences, manifest says {info.sequences}")
        shard_tokens = 0
        for batch_number in range(reader.num_record_batches):
            batch = reader.get_batch(batch_number)
            if batch.num_rows != 1 or any(batch.column(c).offsets[0].as_py() != 0 for c in range(1, batch.num_columns)):
                raise PipelineError(f"{path}: sequence {batch_number} is not laid out as one row per record batch")
            length = len(_row_values(batch, INPUT_IDS))
            if not (len(_row_values(batch, LOSS_MASK)) == len(_row_values(batch, TARGET_NEXT)) == length):
                raise PipelineError(f"{path}: sequence {batch_number} has columns of different lengths")
            if not (len(_row_values(batch, TOPK_IDS)) == len(_row_values(batch, TOPK_LOGPROBS)) == length * manifest.target_top_k):
                raise PipelineError(f"{path}: sequence {batch_number} has top-k columns for a different length or K")
            if manifest.feature_dtype == "fp8_e4m3" and len(_row_values(batch, FEATURE_SCALES)) != length:
                raise PipelineError(f"{path}: sequence {batch_number} has {len(_row_values(batch, FEATURE_SCALES))} scales for {length} tokens")
            if len(_row_values(batch, FEATURES)) != length * manifest.feature_width:
                raise PipelineError(f"{path}: sequence {batch_number} has features for a different length or width")
            shard_tokens += length
        if shard_tokens != info.tokens:
            raise PipelineError(f"{path}: {shard_tokens} tokens, manifest says {info.tokens}")
        sequences += info.sequences
        tokens += shard_tokens
    if (sequences, tokens) != (manifest.sequences, manifest.tokens):
        raise PipelineError(f"{folder / 'manifest.json'}: totals {manifest.sequences} sequences / {manifest.tokens} tokens disagree with its shards")
    return manifest


def open_split(folder: Path, *, expected_fingerprint: str | None = None, verify: str = "full") -> ShardDataset:
    """The entry point train and evaluate use: verify, then open for random access."""
    return ShardDataset(folder, expected_fingerprint=expected_fingerprint, verify=verify)
