"""runtime.py: the device default, hub downloads off unless asked for, and one-line error exits
that let every other exception through with its traceback."""

import pytest
import torch

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.runtime import default_device, offline_by_default, one_line_errors


def test_the_default_device_is_cuda_only_when_present(monkeypatch):
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda"


def test_offline_by_default_keeps_a_users_choice(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    offline_by_default()
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "true"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    offline_by_default()
    assert os.environ["HF_HUB_OFFLINE"] == "0"


def test_one_line_errors_passes_results_and_other_exceptions_through(capsys):
    @one_line_errors
    def command(value):
        """The wrapped command's docstring (click shows it as help)."""
        if value == "bug":
            raise KeyError("a bug keeps its traceback")
        if value == "bad":
            raise PipelineError("bad input")
        return value * 2

    assert command(21) == 42 and command.__doc__.startswith("The wrapped command's docstring")
    with pytest.raises(KeyError):
        command("bug")
    with pytest.raises(SystemExit):
        command("bad")
    assert capsys.readouterr().err == "error: bad input\n"
