"""Pieces shared by the subcommands: error handling, consoles, common option types."""

from __future__ import annotations

import functools
import os
from typing import Annotated

import typer
from rich.console import Console

from modcli.errors import TrainingDiverged, UserError

stdout = Console()
stderr = Console(stderr=True)

Device = Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")]
Dtype = Annotated[str, typer.Option(help="Autocast dtype: float32, bfloat16 or float16.")]
Json = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]


def user_errors(command):
    """Turn a UserError (or a diverged run) into one red line on stderr and its exit code, no traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (UserError, TrainingDiverged) as exc:
            if is_main_process():  # under torchrun every rank fails alike; one message is enough
                stderr.print(f"[red]error: {exc}[/]", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper


def is_main_process() -> bool:
    """Rank 0 under torchrun, or a plain process."""
    return int(os.environ.get("RANK", "0")) == 0
