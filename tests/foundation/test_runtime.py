"""runtime.py: the one `--device` option of the stage scripts and the console command, hub
downloads off unless asked for, and one-line error exits that let every other exception through
with its traceback."""

import importlib.util

import click
import pytest
import torch
from click.testing import CliRunner
from support.helpers import REPO_ROOT

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.runtime import (
    DeviceChoice,
    offline_by_default,
    one_line_errors,
)

STAGES = ("target", "generate", "capture", "train", "evaluate", "export")


def stage_command(stage: str) -> click.Command:
    spec = importlib.util.spec_from_file_location(f"{stage}_stage", REPO_ROOT / "stages" / f"{stage}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_every_command_that_runs_a_model_takes_the_one_device_option():
    from dflash_pipeline.cli import main

    commands = {f"stages/{stage}.py": stage_command(stage) for stage in STAGES}
    commands.update({f"dflash-pipeline {name}": command for name, command in main.commands.items()})
    with_device = {name for name, command in commands.items() if any(p.name == "device" for p in command.params)}
    assert with_device == {"stages/generate.py", "stages/capture.py", "stages/train.py", "stages/evaluate.py",
                           "dflash-pipeline evaluate", "dflash-pipeline decode",
                           "dflash-pipeline generate"}  # decode's old name, for one release
    for name in with_device:
        option = next(p for p in commands[name].params if p.name == "device")
        assert isinstance(option.type, DeviceChoice) and option.default == "auto", name


@pytest.mark.parametrize("stage", ["generate", "capture", "train", "evaluate"])
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "tpu"])
def test_a_device_this_torch_lacks_stops_a_stage_in_one_line_before_anything_is_written(stage, device, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU build of torch, whatever this machine has
    out = tmp_path / "out"
    options = ["--params", REPO_ROOT / "params.yaml", "--out", out, "--device", device] + (["--prompts", tmp_path / "p.jsonl"]
                                                                                       if stage == "generate" else [])
    result = CliRunner().invoke(stage_command(stage), [str(option) for option in options])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --device {device if device != 'tpu' else repr(device)}: "), result.stderr
    assert lines[0].endswith(f"available here: auto, cpu (see '{stage_command(stage).name} --help')") and "Traceback" not in result.output
    if device == "tpu":  # no device at all: the line names the choices, as the console command's does
        assert "not a device (auto, cpu, cuda, cuda:N)" in lines[0], lines[0]
    assert not out.exists() and not list(tmp_path.iterdir())


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
