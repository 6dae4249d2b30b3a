"""devices.py on the CPU: bf16 only where the device computes in it, timing that waits for the
device, and the chip's bf16 peak for model FLOPs utilisation."""

import pytest
import torch

from dflash_pipeline import devices


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
