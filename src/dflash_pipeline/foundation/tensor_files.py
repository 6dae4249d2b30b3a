"""Safetensors files, read in one place: a header (names, dtypes, shapes) without the data, and
the tensors themselves. Checkpoints, exported drafters, the target's weights and the CLI's `show`
all read through here, so a missing or damaged file is the same one line everywhere."""

from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.foundation.errors import PipelineError


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # the file's dtype code: "F32", "BF16", "I64", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


def _unreadable(file: Path, exc: Exception) -> PipelineError:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return PipelineError(f"{file}: unreadable safetensors file ({first})")


def safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """name -> (dtype, shape) of every tensor in `file`, from its header only, in file order."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(Path(file), framework="pt") as handle:
            entries = {}
            for name in handle.keys():
                part = handle.get_slice(name)
                entries[name] = TensorEntry(part.get_dtype(), tuple(part.get_shape()))
            return entries
    except FileNotFoundError:
        raise PipelineError(f"{file}: missing") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise _unreadable(file, exc) from None


def load_safetensors(file: Path, names=None) -> dict:
    """The tensors of `file` (all, or those in `names` that it holds), on the CPU as stored."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(Path(file), framework="pt") as handle:
            wanted = list(handle.keys()) if names is None else [name for name in names if name in set(handle.keys())]
            return {name: handle.get_tensor(name) for name in wanted}
    except FileNotFoundError:
        raise PipelineError(f"{file}: missing") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise _unreadable(file, exc) from None


def safetensors_header_bytes(file: Path) -> bytes:
    """The header of `file` exactly as stored (the JSON of every tensor's name, dtype, shape and byte
    range), read without the data: what the target's fingerprint hashes (`target.load`), so the
    bytes, not a parse of them. A missing or truncated file is the same one line as above."""
    import os
    import struct

    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            size = os.fstat(handle.fileno()).st_size
            if length > size - 8:  # not read: a foreign file's first bytes can say exabytes
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            return handle.read(length)
    except FileNotFoundError:
        raise PipelineError(f"{file}: missing") from None
    except (OSError, ValueError, struct.error) as exc:
        raise _unreadable(file, exc) from None
