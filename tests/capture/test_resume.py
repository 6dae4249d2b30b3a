"""capture/resume.py through the stage: a shard is kept only when its bytes match the sha256 its
writer recorded (the manifest of a finished run, or its `.sha256` file before that); anything
else, a flipped bit that Arrow still reads included, is rebuilt and reported."""

import hashlib
import shutil

import pyarrow as pa
import pytest
from support.helpers import write_generated

from dflash_pipeline.capture.run import run_capture
from dflash_pipeline.data.shards import Manifest, verify_split
from dflash_pipeline.foundation.config import CaptureConfig
from dflash_pipeline.foundation.errors import PipelineError


def _flip_a_feature_byte(shard):
    """Flip one bit inside the first sequence's feature values: the file stays a valid Arrow file
    with the right record-batch count, only its sha256 tells."""
    mapped = pa.memory_map(str(shard), "r")
    reader = pa.ipc.open_file(mapped)
    features = reader.get_batch(0).column("features").values
    mapped.seek(0)
    offset = features.buffers()[1].address - mapped.read_buffer().address + 7
    batches = reader.num_record_batches
    del reader, features, mapped
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x40
    shard.write_bytes(bytes(data))
    assert pa.ipc.open_file(pa.memory_map(str(shard), "r")).num_record_batches == batches


def test_a_corrupted_shard_is_rebuilt_not_recorded(tiny_llama_target, tmp_path, capsys, monkeypatch):
    info = tiny_llama_target
    generated = write_generated(tmp_path / "generated", {"train": 6, "val": 2}, answer_len=(10, 40))
    config = CaptureConfig(layer_ids=[1, 3])
    out = tmp_path / "hidden"

    def capture():
        capsys.readouterr()
        run_capture(config, target=info, generated_dir=generated, out_dir=out, device="cpu")
        return capsys.readouterr().out

    capture()
    split, shard = out / "train", out / "train" / "shard-00000.arrow"
    original = shard.read_bytes()
    assert not list(split.glob("*.sha256"))  # the manifest holds the hashes once the split is done

    # A finished split: the bit flip verify-shards reports is rebuilt, not written into a new manifest.
    _flip_a_feature_byte(shard)
    with pytest.raises(PipelineError, match="sha256 differs from the manifest"):
        verify_split(split)
    printed = capture()
    assert "capture train: rebuilding 1 shard(s) that do not match their recorded sha256: " \
           "shard-00000.arrow (sha256 differs from manifest.json)" in printed, printed
    assert "0 already done" in printed
    verify_split(split)
    assert shard.read_bytes() == original

    # A run killed before its manifest: the shard's own .sha256 record is the reference.
    shutil.rmtree(out)

    def killed(self, folder):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(Manifest, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        capture()
    monkeypatch.undo()
    staged = tmp_path / "hidden.partial" / "train"  # an unfinished run's shards wait beside the output
    assert not out.exists()
    assert (staged / shard.name).is_file() and (staged / "shard-00000.arrow.sha256").is_file() and not (staged / "manifest.json").exists()
    _flip_a_feature_byte(staged / shard.name)
    printed = capture()
    assert "shard-00000.arrow (sha256 differs from shard-00000.arrow.sha256)" in printed, printed
    assert shard.read_bytes() == original
    verify_split(split)

    # A shard with neither record cannot be checked, so it is rebuilt too; an intact one is kept.
    (split / "manifest.json").unlink()
    printed = capture()
    assert "shard-00000.arrow (no recorded sha256 to check it against)" in printed, printed
    (split / "manifest.json").unlink()
    (split / "shard-00000.arrow").write_bytes(original)
    (split / "shard-00000.arrow.sha256").write_text(hashlib.sha256(original).hexdigest() + "  shard-00000.arrow\n")
    printed = capture()
    assert "rebuilding" not in printed and "1 shard(s), 1 already done" in printed, printed
    verify_split(split)
