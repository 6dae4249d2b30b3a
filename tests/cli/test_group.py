"""cli/group.py: the `dflash-pipeline` group: every command explains itself, the installed entry
point, the version, the one `--device` option of the decoding commands, and usage mistakes as one
line `error: ...` with exit status 1."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.console import SUBCOMMANDS, assert_one_line_error, invoke
from support.helpers import stage_env

from dflash_pipeline.cli import main


@pytest.mark.parametrize("command", [[]] + [[name] for name in SUBCOMMANDS])
def test_every_subcommand_explains_itself_with_an_example(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: {' '.join(['main'] + command)}")
    if command:
        assert "Example" in result.output and f"dflash-pipeline {command[0]} " in result.output
    else:
        assert all(name in result.output for name in SUBCOMMANDS)


@pytest.mark.subprocess
def test_installed_console_script_runs_and_fails_in_one_line(cli_run, tmp_path):
    script = Path(sys.executable).parent / "dflash-pipeline"
    assert script.is_file(), "console script missing: pip install --no-deps -e . (pyproject.toml [project.scripts])"
    helped = subprocess.run([script, "--help"], env=stage_env(), capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and all(name in helped.stdout for name in SUBCOMMANDS), helped.stderr
    verified = subprocess.run([script, "verify-shards", cli_run.val], env=stage_env(), capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0 and "ok, 3 sequences" in verified.stdout, verified.stderr
    missing = subprocess.run([script, "show", tmp_path / "nope"], env=stage_env(), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("error: ") and "nope" in missing.stderr


def test_the_group_help_lists_every_registered_command_with_a_one_line_summary():
    result = CliRunner().invoke(main, ["--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    listing = result.output.split("Commands:\n", 1)[1].splitlines()
    listed = sorted(name for name, command in main.commands.items() if not command.hidden)
    assert listed == sorted(SUBCOMMANDS) and sorted(set(main.commands) - set(listed)) == ["generate"]  # decode's old name, hidden
    assert [line.split()[0] for line in listing] == listed, listing  # one line each, none wrapped
    for line in listing:
        name, summary = line.split(maxsplit=1)
        assert summary == main.commands[name].short_help, line  # in full, not cut short with "..."


def test_version_prints_the_package_version():
    from importlib.metadata import version

    import dflash_pipeline

    for flag in ("--version", "-V"):
        result = invoke(flag)
        assert result.exit_code == 0 and result.output == f"dflash-pipeline, version {dflash_pipeline.__version__}\n", result.output
    assert dflash_pipeline.__version__ == version("dflash-pipeline")  # pyproject.toml's


@pytest.mark.parametrize("command", [name for name in main.commands if any(p.name == "device" for p in main.commands[name].params)])
def test_a_bad_device_is_a_one_line_error(command, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU build of torch, whatever this machine has
    arguments = {"evaluate": [tmp_path, "--target", tmp_path, "--shards", tmp_path],
                 "decode": ["hi", "--target", tmp_path, "--drafter", tmp_path]}
    arguments = arguments[command] if command in arguments else arguments["decode"]  # `generate`, decode's old name: before its notice
    assert_one_line_error(invoke(command, *arguments, "--device", "tpu"), "--device 'tpu': not a device", "available here: auto, cpu")
    for device in ("cuda", "cuda:1"):  # torch's own 41-line AssertionError once the models started loading
        assert_one_line_error(invoke(command, *arguments, "--device", device), f"--device {device}: ", "available here: auto, cpu")


def test_the_device_option_appears_on_the_decoding_commands():
    assert {name for name in SUBCOMMANDS if any(p.name == "device" for p in main.commands[name].params)} == {"evaluate", "decode"}
