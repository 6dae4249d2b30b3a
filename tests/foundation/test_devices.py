"""devices.py on the CPU: the one check of a chosen device, bf16 only where the device computes
in it, timing that waits for the device, and the chip's bf16 peak for model FLOPs utilisation."""

import pytest
import torch

from dflash_pipeline.foundation import devices
from dflash_pipeline.foundation.errors import PipelineError


def test_the_default_device_is_cuda_only_when_present(monkeypatch):
    assert devices.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.default_device() == "cpu" and devices.checked_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.default_device() == "cuda" and devices.checked_device("auto") == "cuda"


def test_a_device_torch_cannot_reach_is_one_line_naming_the_option_and_what_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.checked_device("cpu") == "cpu"
    for name in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(PipelineError) as error:
            devices.checked_device(name, option="--device")
        assert str(error.value).startswith(f"--device {name}: ") and str(error.value).endswith("available here: auto, cpu")
    for name in ("tpu", "gpu", "cuda:", "cuda:x", "CPU", ""):
        with pytest.raises(PipelineError, match=r"^--dev '.*': not a device \(auto, cpu, cuda, cuda:N\); available here: auto, cpu$"):
            devices.checked_device(name, option="--dev")


def test_cuda_n_is_checked_against_the_device_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [devices.checked_device(name) for name in ("cuda", "cuda:0", "cuda:1")] == ["cuda", "cuda:0", "cuda:1"]
    with pytest.raises(PipelineError, match=r"^--device cuda:2: this machine has 2 CUDA device\(s\); "
                                            r"available here: auto, cpu, cuda, cuda:0, cuda:1$"):
        devices.checked_device("cuda:2")


def test_the_bf16_peak_is_none_on_cpu_and_an_override_wins(monkeypatch):
    monkeypatch.delenv("PEAK_TFLOPS", raising=False)
    assert devices.bf16_peak_tflops("cpu") is None
    monkeypatch.setenv("PEAK_TFLOPS", "123.5")
    assert devices.bf16_peak_tflops("cpu") == 123.5


def test_a_cuda_chip_is_found_by_name_in_the_table(monkeypatch):
    monkeypatch.delenv("PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert devices.bf16_peak_tflops("cuda:0") == devices.BF16_PEAK_TFLOPS["H100"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert devices.bf16_peak_tflops("cuda") is None


def test_elapsed_counts_from_a_perf_counter_start():
    import time

    started = time.perf_counter()
    time.sleep(0.01)
    assert devices.elapsed("cpu", started) == pytest.approx(0.01, abs=0.5) and devices.elapsed("cpu", started) >= 0.01


def test_timing_helper():
    result, seconds = devices.timed(lambda: sum(range(1000)), "cpu")
    assert result == 499500 and seconds >= 0
    assert devices.bf16_by_default("cuda:1") and not devices.bf16_by_default("cpu")
    with devices.autocast("cpu", enabled=True):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with devices.autocast("cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_the_targets_dtype_is_chosen_in_one_place():
    """bf16 on CUDA, fp32 on a CPU (`devices.compute_dtype`), for the target's weights and its
    frozen head alike; it was spelled out at six call sites (issue #46)."""
    import re

    from support.helpers import REPO_ROOT

    assert devices.compute_dtype("cpu") == torch.float32
    assert devices.compute_dtype("cuda") == devices.compute_dtype("cuda:1") == torch.bfloat16
    spelled = re.compile(r"torch\.bfloat16 if .*(cuda|bf16_by_default|CUDA).* else torch\.float32")
    files = [path for folder in ("src", "bench", "stages") for path in sorted((REPO_ROOT / folder).rglob("*.py"))]
    offenders = [f"{path.relative_to(REPO_ROOT)}:{number}" for path in files if path.name != "devices.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if spelled.search(line)]
    assert offenders == []
