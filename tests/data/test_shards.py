"""The shard format: schema pinned, bit-exact bf16, fp8 option, overhead, and the verifier."""

import json

import numpy as np
import pytest
import torch

from dflash_pipeline.data.shards import (
    Manifest,
    ShardWriter,
    bytes_per_token,
    open_split,
    shard_schema,
)
from dflash_pipeline.foundation.errors import PipelineError


def _sequences(count=3, width=12, seed=0, base_length=5):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        length = base_length + 3 * index
        out.append(
            dict(
                sequence_id=f"seq{index}",
                input_ids=torch.randint(0, 49152, (length,), generator=generator).numpy(),
                loss_mask=np.array([0, 0] + [1] * (length - 2), dtype=np.uint8),
                target_next=torch.randint(0, 49152, (length,), generator=generator).numpy(),
                features=torch.randn(length, width, generator=generator) * 3,
            )
        )
    return out


def write_split(folder, sequences, *, feature_dtype="bf16", width=12, fingerprint="f" * 64, per_shard=2, top_k=0):
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in range(0, len(sequences), per_shard):
        writer = ShardWriter(folder / f"shard-{start // per_shard:05d}.arrow", feature_dtype=feature_dtype, feature_width=width,
                             top_k=top_k)
        for sequence in sequences[start : start + per_shard]:
            writer.write(**sequence)
        shards.append(writer.close())
    manifest = Manifest(
        split="train", target_fingerprint=fingerprint, layer_ids=[1, 2], hidden_size=width // 2, num_target_layers=4,
        feature_dtype=feature_dtype, feature_width=width, sequences=len(sequences),
        tokens=sum(len(s["input_ids"]) for s in sequences), loss_tokens=sum(int(s["loss_mask"].sum()) for s in sequences),
        shards=shards, target_top_k=top_k,
    )
    manifest.save(folder)
    return manifest


def test_schema_is_pinned():
    schema = shard_schema("bf16", 12)
    assert [(f.name, str(f.type)) for f in schema] == [
        ("sequence_id", "string"),
        ("input_ids", "list<item: int32>"),
        ("loss_mask", "list<item: uint8>"),
        ("target_next", "list<item: int32>"),
        ("target_topk_ids", "list<item: int32>"),
        ("target_topk_logprobs", "list<item: float>"),
        ("features", "large_list<item: uint16>"),
    ]
    assert schema.metadata == {b"dflash.shard_format_version": b"2", b"dflash.feature_dtype": b"bf16", b"dflash.feature_width": b"12",
                               b"dflash.target_top_k": b"0"}
    assert shard_schema("bf16", 12, 32).metadata[b"dflash.target_top_k"] == b"32"
    assert [f.name for f in shard_schema("fp8_e4m3", 12)][-2:] == ["features", "feature_scales"]


def test_bf16_round_trip_is_bit_exact(tmp_path):
    sequences = _sequences()
    write_split(tmp_path, sequences)
    dataset = open_split(tmp_path, expected_fingerprint="f" * 64)
    assert len(dataset) == 3 and dataset.lengths() == [5, 8, 11]
    for index, expected in enumerate(sequences):
        sample = dataset[index]
        assert sample.sequence_id == expected["sequence_id"]
        assert sample.features.dtype == torch.bfloat16 and sample.features.shape == expected["features"].shape
        assert torch.equal(sample.features.view(torch.int16), expected["features"].to(torch.bfloat16).view(torch.int16))
        assert sample.input_ids.tolist() == expected["input_ids"].tolist()
        assert sample.loss_mask.tolist() == expected["loss_mask"].tolist()
        assert sample.target_next.tolist() == expected["target_next"].tolist()


def test_fp8_halves_the_bytes_within_e4m3_precision(tmp_path):
    sequences = _sequences(width=256, base_length=200)
    bf16 = write_split(tmp_path / "bf16", sequences, width=256)
    fp8 = write_split(tmp_path / "fp8", sequences, width=256, feature_dtype="fp8_e4m3")
    ratio = sum(s.bytes for s in fp8.shards) / sum(s.bytes for s in bf16.shards)
    assert 0.45 < ratio < 0.56
    dataset = open_split(tmp_path / "fp8")
    for index, expected in enumerate(sequences):
        restored = dataset[index].features.float()
        reference = expected["features"]
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; tiny values
        # (below the per-token scale's subnormal range) are off by at most absmax * 2^-9.
        bound = reference.abs() * 2**-4 + reference.abs().amax(-1, keepdim=True) * 2**-9 + 1e-2 * reference.abs()
        assert bool((restored - reference).abs().le(bound).all())


def test_shard_bytes_are_within_two_percent_of_the_payload(tmp_path):
    # Realistic shapes for the default target: 5 taps x 576 = 2880 features, 40-600 tokens.
    width = 2880
    generator = torch.Generator().manual_seed(1)
    sequences = []
    for index, length in enumerate([40, 90, 150, 300, 600]):
        sequences.append(dict(sequence_id=f"{index:016x}", input_ids=np.arange(length), loss_mask=np.ones(length, np.uint8),
                              target_next=np.arange(length), features=torch.randn(length, width, generator=generator)))
    manifest = write_split(tmp_path, sequences, width=width, per_shard=5)
    payload = manifest.tokens * bytes_per_token(width, "bf16")
    assert sum(s.bytes for s in manifest.shards) / payload <= 1.02


def _corrupt(folder, how):
    shard = folder / "shard-00000.arrow"
    data = bytearray(shard.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "foreign":
        (folder / "shard-00099.arrow").write_bytes(bytes(data))
    elif how == "missing":
        (folder / "shard-00001.arrow").unlink()
    elif how == "manifest":
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["feature_width"] = 13
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder / ("shard-00099.arrow" if how == "foreign" else "shard-00001.arrow" if how == "missing" else "shard-00000.arrow")


@pytest.mark.parametrize(
    "how, message",
    [
        ("flip", "sha256 differs from the manifest"),
        ("truncate", "manifest says"),
        ("foreign", "not listed in the manifest"),
        ("missing", "listed in the manifest is missing"),
        ("manifest", "schema differs"),
    ],
)
def test_verifier_names_the_bad_file(tmp_path, how, message):
    write_split(tmp_path, _sequences())
    bad_file = _corrupt(tmp_path, how)
    with pytest.raises(PipelineError) as error:
        open_split(tmp_path)
    text = str(error.value)
    assert message in text and "\n" not in text
    assert text.startswith(str(bad_file) if how != "manifest" else str(tmp_path / "shard-00000.arrow"))


def test_foreign_target_and_missing_manifest_are_refused(tmp_path):
    write_split(tmp_path / "a", _sequences())
    with pytest.raises(PipelineError, match="captured from target ffffffffffff, but the current target is 000000000000"):
        open_split(tmp_path / "a", expected_fingerprint="0" * 64)
    with pytest.raises(PipelineError, match="no manifest; run the `capture` stage"):
        open_split(tmp_path / "empty")


def test_writer_rejects_mismatched_lengths(tmp_path):
    writer = ShardWriter(tmp_path / "shard-00000.arrow", feature_dtype="bf16", feature_width=12)
    sequence = _sequences(1)[0]
    sequence["loss_mask"] = sequence["loss_mask"][:-1]
    with pytest.raises(ValueError, match="seq0: lengths disagree"):
        writer.write(**sequence)
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def _with_top_k(sequences, top_k, seed=3):
    generator = torch.Generator().manual_seed(seed)
    for sequence in sequences:
        length = len(sequence["input_ids"])
        sequence["topk_ids"] = torch.randint(0, 49152, (length, top_k), generator=generator).numpy().astype(np.int32)
        sequence["topk_logprobs"] = -torch.rand(length, top_k, generator=generator).numpy() * 20
    return sequences


@pytest.mark.parametrize("feature_dtype", ["bf16", "fp8_e4m3"])
def test_target_top_k_round_trip_is_exact(tmp_path, feature_dtype):
    sequences = _with_top_k(_sequences(count=5), top_k=4)
    write_split(tmp_path, sequences, feature_dtype=feature_dtype, top_k=4)
    dataset = open_split(tmp_path)
    assert dataset.manifest.target_top_k == 4
    for index, expected in enumerate(sequences):
        sample = dataset[index]
        assert sample.target_topk_ids.shape == (len(expected["input_ids"]), 4)
        assert np.array_equal(sample.target_topk_ids.numpy(), expected["topk_ids"])
        assert np.array_equal(sample.target_topk_logprobs.numpy(), expected["topk_logprobs"].astype(np.float32))
        assert np.array_equal(sample.target_next.numpy(), expected["target_next"])
    # Without top-k every sample still has [S, 0] tensors, and the writer refuses a wrong K.
    write_split(tmp_path / "none", _sequences(count=2))
    assert open_split(tmp_path / "none")[1].target_topk_ids.shape == (8, 0)
    writer = ShardWriter(tmp_path / "bad.arrow", feature_dtype="bf16", feature_width=12, top_k=3)
    with pytest.raises(ValueError, match="top-k"):
        writer.write(**_with_top_k(_sequences(count=1), top_k=4)[0])
    writer.abort()


def test_shards_of_format_version_1_are_refused_in_one_line(tmp_path):
    write_split(tmp_path, _sequences())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["format_version"] = 1
    del manifest["target_top_k"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PipelineError, match=r"manifest.json: shard format_version 1, this code reads only 2; recapture") as error:
        open_split(tmp_path)
    assert "\n" not in str(error.value)
