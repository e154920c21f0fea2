"""Pieces shared by the subcommands: the wrapper every command runs in (errors as one line), the consoles."""

from __future__ import annotations

import contextlib
import functools
import os

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

import modcli
from modcli.errors import ReportedError

stdout = Console()
stderr = Console(stderr=True)


def subcommand(command):
    """What every subcommand runs in. First the CPU allocator is tuned, before the command makes a tensor (steady
    CPU step times: modcli.hardware.tune_cpu_allocator); here rather than in `main`, because modcli.hardware
    imports torch and `modcli --help` should not wait for it. Then a ReportedError (a user's mistake: exit 2; a
    diverged run: 3; a failed write: 1) becomes one red line on stderr and its exit code, no traceback. Any other
    exception is an internal failure and keeps its traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        modcli.tune_cpu_allocator()
        try:
            return command(*args, **kwargs)
        except Exception as exc:
            if _out_of_memory(exc):
                if is_main_process():
                    print_error(f"out of memory: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; ask for "
                                "a smaller model, batch or sequence length")
                raise typer.Exit(2) from None
            if not _reported(exc):
                raise
            if is_main_process():  # under torchrun every rank fails alike; one message is enough
                print_error(str(exc))
            raise typer.Exit(exc.exit_code) from None

    return wrapper


def _reported(exc: Exception) -> bool:
    """modcli's ReportedErrors, and the PyTorch-free runtime's BundleError (exit 2), which `modcli generate` and
    `modcli profile --onnx` meet through the code they share with it."""
    return isinstance(exc, ReportedError) or (type(exc).__name__ == "BundleError"
                                              and type(exc).__module__.startswith("modcli_runtime"))


def _out_of_memory(exc: Exception) -> bool:
    """An allocation the machine cannot make (a model, batch or sequence too large for it): the request is what
    needs to change, so it is reported like a user's mistake (exit 2), not as an internal failure."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def print_error(message: str) -> None:
    """One red line on stderr: `error: message` (line breaks inside the message become spaces)."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    stderr.print(f"[red]error: {escape(line)}[/]", highlight=False, soft_wrap=True)


USAGE_ERROR = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "UsageError")
"""click's UsageError as typer raises it (typer >= 0.20 carries its own copy of click)."""


@contextlib.contextmanager
def _one_line_usage_errors():
    try:
        yield
    except USAGE_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `modcli` alone prints its help
            raise
        hint = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        print_error(exc.format_message() + hint)
        raise typer.Exit(exc.exit_code) from None


class OneLineErrors(TyperGroup):
    """The root command group: a flag that does not parse (a bad value, an unknown option or command) is one red
    line and exit code 2, like every other user mistake, instead of click's usage block."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with _one_line_usage_errors():
            return super().invoke(ctx)


def is_main_process() -> bool:
    """Rank 0 under torchrun, or a plain process."""
    return int(os.environ.get("RANK", "0")) == 0
