"""Where a target's layers go when it is larger than one device: `target.device_map`,
`target.max_memory` and `target.offload_folder` handed to transformers/accelerate.

`TargetPlacement.whole()` (no device map) is today's load: the whole target on the stage's device.
A map splits it: "auto" fills this process's replica of GPUs (`launch.devices_per_replica`, from
the rank's first GPU), then the CPU, then disk, within `max_memory`; an explicit map names a device
per module. The map is computed here, before any weight is read (accelerate's
`infer_auto_device_map` over an empty model), so a device that does not exist, or a layer sent to
disk without an offload folder, stops the stage in one line naming the key, and the map itself is
recorded.

A split target computes what the whole one does: each layer runs on its execution device with its
own weights (offloaded ones are copied in for the layer's forward and dropped after), in the same
dtype, so on a CPU the answers and hidden states are identical (tests/target/test_placement.py).
What the decoding engine does with one: `decoding.static_decoder` keeps each layer's KV cache on
that layer's execution device, and a split target's steps are never captured as CUDA graphs
(weights copied in by hooks cannot be replayed), so they run eagerly: slower, same answers.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_pipeline.foundation.errors import PipelineError

# Devices a map may name besides GPUs: layers kept in host memory, or read from the offload folder.
HOST_DEVICES = ("cpu", "disk")


@dataclass(frozen=True)
class TargetPlacement:
    """How a target is placed over devices (params.yaml target.device_map, .max_memory,
    .offload_folder and launch.devices_per_replica); `source` is named in errors."""

    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None
    devices_per_replica: int = 1
    source: str = "params.yaml"

    @classmethod
    def whole(cls) -> "TargetPlacement":
        return cls()

    @classmethod
    def from_params(cls, params, source: str = "params.yaml") -> "TargetPlacement":
        target, launch = params.target, params.launch
        return cls(device_map=target.device_map, max_memory=target.max_memory, offload_folder=target.offload_folder,
                   devices_per_replica=launch.devices_per_replica, source=source)

    @property
    def split(self) -> bool:
        return self.device_map is not None

    def key_error(self, key: str, why: str) -> PipelineError:
        return PipelineError(f"{self.source}: key 'target.{key}' {why}")


def _device_of(value, placement: TargetPlacement, key: str = "device_map"):
    """A map's device value in accelerate's spelling (GPU index int, "cpu", "disk"), checked against this machine."""
    if isinstance(value, str) and value in HOST_DEVICES:
        return value
    index = value
    if isinstance(value, str) and value.startswith("cuda"):
        index = int(value.split(":", 1)[1]) if ":" in value and value.split(":", 1)[1].isdigit() else (0 if value == "cuda" else None)
    if not isinstance(index, int) or isinstance(index, bool):
        raise placement.key_error(key, f"names device {value!r}: expected a GPU index, 'cuda:N', 'cpu' or 'disk'")
    if index >= torch.cuda.device_count() or index < 0:
        raise placement.key_error(key, f"names device {value!r}, and this machine has {torch.cuda.device_count()} GPU(s)")
    return index


def _replica_gpus(device: str, placement: TargetPlacement) -> list[int]:
    """The GPU indices of this process's replica: devices_per_replica GPUs from `device`'s."""
    if not device.startswith("cuda"):
        return []
    first = torch.device(device).index or 0
    gpus = list(range(first, first + placement.devices_per_replica))
    if gpus[-1] >= torch.cuda.device_count():
        raise PipelineError(f"{placement.source}: key 'launch.devices_per_replica' {placement.devices_per_replica} from GPU {first} "
                            f"needs GPUs up to {gpus[-1]}, this machine has {torch.cuda.device_count()}")
    return gpus


def _memory_budget(device: str, placement: TargetPlacement) -> dict:
    """accelerate's max_memory for this replica: its GPUs and the CPU, at what each has unless
    target.max_memory says less (a GPU outside the replica gets nothing)."""
    from accelerate.utils import get_max_memory

    available = get_max_memory()
    allowed = {gpu: available[gpu] for gpu in _replica_gpus(device, placement)}
    allowed["cpu"] = available["cpu"]
    for key, size in (placement.max_memory or {}).items():
        name = _device_of(key, placement, "max_memory") if key != "disk" else None
        if name is None or name not in allowed:
            raise placement.key_error("max_memory", f"names {key!r}, not a device of this process's replica "
                                      f"({', '.join(str(k) for k in allowed)})")
        allowed[name] = _bytes_of(size, key, placement)
    return allowed


def _bytes_of(size, key, placement: TargetPlacement) -> int:
    """A max_memory size (bytes, or '70GiB', '500MB', ...) in bytes."""
    from accelerate.utils import convert_file_size_to_int

    if isinstance(size, int) and not isinstance(size, bool):
        return size
    try:
        return int(size) if isinstance(size, str) and size.strip().isdigit() else convert_file_size_to_int(size)
    except (ValueError, TypeError, AttributeError):
        raise placement.key_error("max_memory", f"gives {key!r} the size {size!r}: expected bytes or a size like '70GiB'") from None


def plan_device_map(model_dir: Path, placement: TargetPlacement, *, device: str, dtype: torch.dtype) -> dict:
    """The module -> device map a split target is loaded with (accelerate's spelling), computed
    without reading a weight; checked before any is read."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(placement.device_map, dict):
        device_map = {str(module): _device_of(value, placement) for module, value in placement.device_map.items()}
    else:
        config = AutoConfig.from_pretrained(model_dir)
        with init_empty_weights():
            empty = AutoModelForCausalLM.from_config(config, dtype=dtype)
        empty.tie_weights()  # tied embedding and head are placed together, counted once
        device_map = dict(infer_auto_device_map(empty, max_memory=_memory_budget(device, placement),
                                                no_split_module_classes=empty._no_split_modules or [], dtype=dtype))
    if "disk" in device_map.values() and placement.offload_folder is None:
        on_disk = sorted(module for module, value in device_map.items() if value == "disk")
        raise placement.key_error("offload_folder", f"is null, and the device map puts {len(on_disk)} module(s) on disk "
                                  f"({on_disk[0]}{', ...' if len(on_disk) > 1 else ''}); name a folder for them, or give "
                                  "target.max_memory more room")
    return device_map


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: the execution device accelerate's hook gives it (an offloaded
    layer's weights live on the CPU or disk but run there), else where its first weight is."""
    hook = getattr(module, "_hf_hook", None)
    executes_on = getattr(hook, "execution_device", None)
    if executes_on is not None:
        return torch.device(executes_on if not isinstance(executes_on, int) else f"cuda:{executes_on}")
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def is_split(model) -> bool:
    """Whether `model` was loaded with a device map that places it over more than one device or
    offloads part of it (accelerate's `hf_device_map`)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    return len(set(device_map.values())) > 1 or "disk" in device_map.values()


def model_device(model) -> torch.device:
    """Where a target's inputs go and its decode state lives: the execution device of its input
    embedding (for a whole target, the device of its weights)."""
    return execution_device(model.get_input_embeddings())


def weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """The target's weights in `dtype`, in bytes, from its safetensors headers (no weight is read)."""
    from dflash_pipeline.foundation.tensor_files import safetensors_header
    from dflash_pipeline.target.folder import weight_files

    width = torch.empty((), dtype=dtype).element_size()
    return sum(entry.numel * width for file in sorted(set(weight_files(model_dir).values()))
               for entry in safetensors_header(file).values())


def memory_available(device: str) -> int:
    """Bytes free for a model on `device`: the GPU's free memory, or the host's MemAvailable."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# The share of a device's free memory a whole target may take: the rest holds the KV cache,
# activations and the drafter during end-to-end decoding.
WHOLE_TARGET_SHARE = 0.8


def whole_target_problem(model_dir: Path, device: str, dtype: torch.dtype) -> str | None:
    """Why the whole target cannot be loaded on `device` (its weights past WHOLE_TARGET_SHARE of the
    free memory there), or None."""
    needed, free = weight_bytes(model_dir, dtype), memory_available(device)
    if needed <= WHOLE_TARGET_SHARE * free:
        return None
    return (f"the target's weights are {needed / 2**30:.1f} GiB in {str(dtype).replace('torch.', '')}, more than "
            f"{WHOLE_TARGET_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device}; set target.device_map (docs/scale.md) "
            "to decode on a split target")
