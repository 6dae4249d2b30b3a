"""Process-level helpers shared by the commands (the stage scripts and `dflash-pipeline`): the
`--device` option, offline mode, error exits."""

import functools
import os
import sys

import click

from dflash_pipeline.foundation.errors import PipelineError


class DeviceChoice(click.ParamType):
    """`--device`: auto, cpu, cuda or cuda:N, checked against this machine where it is parsed
    (`devices.checked_device`), so a device the installed torch lacks stops the command in one
    line before anything loads or is written. The command receives the resolved device."""

    name = "device"

    def get_metavar(self, param, ctx=None) -> str:
        return "[auto|cpu|cuda|cuda:N]"

    def convert(self, value, param, ctx) -> str:
        from dflash_pipeline.foundation.devices import checked_device

        try:
            return checked_device(str(value), option=param.opts[0] if param is not None else "--device")
        except PipelineError as exc:
            raise click.UsageError(str(exc), ctx=ctx) from None


def device_option(command):
    """The one `--device` option of every command that runs a model (default auto)."""
    return click.option("--device", type=DeviceChoice(), default="auto", show_default=True,
                        help="Where the models run: auto (cuda when available, else cpu), cpu, cuda or cuda:N.")(command)


class OneLineUsage:
    """Mixed into a click command or group: its usage mistakes (missing argument, path that does
    not exist, bad option value, unknown command) are one line `error: ...` and exit 1, like every
    other failure."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.ClickException as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) is not None else ""
            click.echo(f"error: {' '.join(exc.format_message().split())}{hint}", err=True)
            sys.exit(1)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


class OneLineCommand(OneLineUsage, click.Command):
    """A stage script's command: usage mistakes are one line, as its other failures are."""


def offline_by_default() -> None:
    """Hub downloads are off unless the user turned them on (HF_HUB_OFFLINE=0).

    Set before transformers is imported, since huggingface_hub reads the variable at import.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def one_line_errors(command):
    """Turn a PipelineError into `error: <message>` on stderr and exit status 1, no traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PipelineError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)

    return wrapper
