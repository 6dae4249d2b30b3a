"""What depends on the device: which devices this machine has (the one check of a `--device`
choice), where compute runs in bf16, and timing that waits for the device.

CUDA runs the drafter under bf16 autocast (the target and its head are stored in bf16 there); the
CPU computes in fp32 by default so results are exact and reproducible. Tests turn bf16 on for the
CPU to run the GPU's arithmetic path where no GPU is present.
"""

import os
import re
import time

import torch

from dflash_pipeline.foundation.errors import PipelineError

# How many steps a device loop runs between two reads back to the host (decode loops: tokens made
# and rows ended; train: the curve values), where each read drains the queue of launched work on a
# GPU. One interval for every loop of the package.
READ_EVERY = 16


def default_read_every(device) -> int:
    """READ_EVERY on a GPU; 1 on a CPU, where a read costs nothing (the value is computed already),
    so a decode loop reads after every step there and never runs a step past the end."""
    return READ_EVERY if torch.device(device).type == "cuda" else 1

# Dense bf16 tensor-core peaks by the vendors' datasheets (SXM parts), TFLOP/s. PEAK_TFLOPS overrides.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0, "4090": 165.0}


# How a device is named wherever one is chosen (the console command and every stage script):
# auto is cuda when available, else cpu; cuda:N is the N-th GPU.
DEVICE_SPELLINGS = ("auto", "cpu", "cuda", "cuda:N")


def default_device() -> str:
    """CUDA when present (bf16 compute there), else CPU (fp32: this CPU class lacks bf16 units)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def available_devices() -> list[str]:
    """The devices this machine offers, as a `--device` names them."""
    if not torch.cuda.is_available():
        return ["auto", "cpu"]
    return ["auto", "cpu", "cuda", *(f"cuda:{index}" for index in range(torch.cuda.device_count()))]


def checked_device(name: str, *, option: str = "--device") -> str:
    """`name` resolved (auto: `default_device`) once this machine is known to have it: a spelling
    that is no device, or a device the installed torch cannot reach, is one line naming `option`
    and what is available, before anything loads or is written."""
    available = ", ".join(available_devices())
    spelled = re.fullmatch(r"auto|cpu|cuda(?::(\d+))?", name)
    if spelled is None:
        raise PipelineError(f"{option} {name!r}: not a device ({', '.join(DEVICE_SPELLINGS)}); available here: {available}")
    if name == "auto":
        return default_device()
    if name.startswith("cuda") and not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
               else "no CUDA device is visible (CUDA_VISIBLE_DEVICES, the driver)")
        raise PipelineError(f"{option} {name}: {why}; available here: {available}")
    if spelled[1] is not None and int(spelled[1]) >= torch.cuda.device_count():
        raise PipelineError(f"{option} {name}: this machine has {torch.cuda.device_count()} CUDA device(s); available here: {available}")
    return name


def bf16_by_default(device) -> bool:
    """Whether `device` computes in bf16 unless told otherwise: CUDA yes, CPU no."""
    return torch.device(device).type == "cuda"


def compute_dtype(device) -> torch.dtype:
    """The dtype the target computes in on `device`, its weights and its frozen head alike: bf16 on
    CUDA, fp32 on a CPU (`bf16_by_default`). Chosen here and nowhere else."""
    return torch.bfloat16 if bf16_by_default(device) else torch.float32


def autocast(device, enabled: bool | None = None):
    """bf16 autocast for `device`'s own type (CPU autocast exists too), on when `enabled` says so,
    else where `bf16_by_default` says so."""
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16_by_default(device) if enabled is None else enabled)


def synchronize(device) -> None:
    """Wait until `device` has finished its queued work (a no-op on CPU, where work is synchronous)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(device, started: float) -> float:
    """Seconds since `started` (a `time.perf_counter()` value), once `device` has finished."""
    synchronize(device)
    return time.perf_counter() - started


def timed(function, device):
    """(result, seconds) of `function()`, timed from a synchronised start to a synchronised end."""
    synchronize(device)
    started = time.perf_counter()
    result = function()
    return result, elapsed(device, started)



def bf16_peak_tflops(device) -> float | None:
    """The dense bf16 peak of `device`'s chip (for model FLOPs utilisation); None where unknown or on CPU."""
    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"])
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((peak for chip, peak in BF16_PEAK_TFLOPS.items() if chip in name), None)


def machine_description() -> str:
    """This machine in words for a benchmark's record: the CPU model (or the GPU's name) and the
    core count, since the same code runs 2-4x apart on different CPUs."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), model)
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{model}, {os.cpu_count()} CPUs{gpu}"


def configure_attention(device) -> None:
    """The one choice of attention kernels, made where a target is loaded: on CUDA, no cuDNN
    attention. torch >= 2.9 tries cuDNN first on Hopper, and cuDNN builds a plan for every new key
    length: 1.5 ms of host time per call, ~45 ms of every 30-layer decode step on an H200, where
    each decode, verify and draft has a new length. Flash and memory-efficient attention need no
    plan. Elsewhere nothing changes."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)

