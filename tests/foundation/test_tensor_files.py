"""The one safetensors reader: headers without data, chosen tensors, and one line for a missing,
cut or foreign file."""

import pytest
import torch
from safetensors.torch import save_file

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.tensor_files import load_safetensors, safetensors_header, safetensors_header_bytes


def test_header_and_tensors_read_back_what_was_written(tmp_path):
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(2).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "w.safetensors")
    header = safetensors_header(tmp_path / "w.safetensors")
    assert {name: (entry.dtype, entry.shape, entry.numel) for name, entry in header.items()} == {
        "a.weight": ("F32", (3, 4), 12), "b": ("I64", (5,), 5), "c": ("BF16", (2,), 2)}
    loaded = load_safetensors(tmp_path / "w.safetensors")
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert set(load_safetensors(tmp_path / "w.safetensors", ["b", "not-there"])) == {"b"}


@pytest.mark.parametrize("damage, why", [("missing", "missing"), ("cut", "unreadable safetensors file"),
                                         ("foreign", "unreadable safetensors file")])
def test_a_missing_cut_or_foreign_file_is_one_line_naming_it(tmp_path, damage, why):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(64, 64)}, path)
    if damage == "missing":
        path.unlink()
    elif damage == "cut":
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.write_text('{"not": "safetensors"}')
    for read in (safetensors_header, load_safetensors):
        with pytest.raises(PipelineError, match=rf"^{path}: {why}") as raised:
            read(path)
        assert "\n" not in str(raised.value)


def test_the_raw_header_is_the_files_own_bytes_and_a_short_or_missing_file_is_one_line(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(4, 4)}, path, metadata={"format": "pt"})
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    assert safetensors_header_bytes(path) == data[8 : 8 + length] and data[8:9] == b"{"
    for damaged in (data[: 8 + length // 2], data[:5], b'{"not": "safetensors"}'):
        path.write_bytes(damaged)
        with pytest.raises(PipelineError, match=rf"^{path}: unreadable safetensors file"):
            safetensors_header_bytes(path)
    path.unlink()
    with pytest.raises(PipelineError, match=rf"^{path}: missing$"):
        safetensors_header_bytes(path)
