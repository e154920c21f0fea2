"""Pieces shared by the subcommands: error handling, consoles, common option types."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from modcli.errors import ReportedError

stdout = Console()
stderr = Console(stderr=True)

Device = Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")]
Dtype = Annotated[str, typer.Option(help="Autocast dtype: float32, bfloat16 or float16.")]
Json = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]

# Model flags shared by `train` and `profile` (a fresh model's shape and routing).
Capacity = Annotated[Optional[float], typer.Option(help="Fraction of tokens a routed block processes.")]
RouteEvery = Annotated[Optional[int], typer.Option(help="Route every N-th block (2 = every other).")]
RouteOffset = Annotated[Optional[int], typer.Option(help="Index of the first routed block.")]
Router = Annotated[Optional[str], typer.Option(
    help="Router kind: topk, random, threshold, attention (A-MoD) or integrated (MoDE with no-op experts).")]
RouterWeight = Annotated[Optional[str], typer.Option(help="sigmoid, identity or none.")]
RouterHidden = Annotated[Optional[int], typer.Option(help="MLP router width (0 = linear).")]
Threshold = Annotated[Optional[float], typer.Option(
    help="threshold router: process a token when sigmoid(logit) > this (default 0.5).")]
CapacityMax = Annotated[Optional[float], typer.Option(
    help="threshold router: most tokens kept in static shapes (default 2 x capacity).")]
RouteLayers = Annotated[Optional[str], typer.Option(
    help="Route exactly these blocks, comma-separated (e.g. 1,3,5), instead of --route-every.")]
RoutePart = Annotated[Optional[str], typer.Option(
    help="What routing skips: block (attention and MLP), attention or mlp.")]
Experts = Annotated[Optional[int], typer.Option(
    help="Mixture-of-experts MLP with this many experts in every block (0 = the dense MLP).")]
ExpertTopK = Annotated[Optional[int], typer.Option(help="Experts each token chooses (token choice, default 1).")]
ExpertCapacityFactor = Annotated[Optional[float], typer.Option(
    help="Training only: expert slots per sequence = factor x tokens x top-k / experts (default 1.25).")]
NoopExperts = Annotated[Optional[int], typer.Option(
    help="--router integrated (integrated MoDE): no-op experts in the routed blocks' MoE.")]
PredictorHidden = Annotated[Optional[int], typer.Option(help="Causal predictor width (0 = none).")]
Arch = Annotated[Optional[str], typer.Option(
    help="Model family: mod (Mixture-of-Depths, default; dense with --dense), early-exit (LayerSkip) or recursion "
         "(Mixture-of-Recursions).")]
Recursions = Annotated[Optional[int], typer.Option(
    help="--arch recursion: times the shared stack runs; --n-layers = 2 + recursions x shared blocks (default 3).")]
RecursionCapacities = Annotated[Optional[str], typer.Option(
    help="--arch recursion: share of tokens each step keeps, comma-separated, non-increasing (default 1,0.67,0.33).")]
LayerDropoutMax = Annotated[Optional[float], typer.Option(
    help="--arch early-exit: layer dropout of the last block, rising linearly from 0 at the first (default 0.1).")]
ExitLossScale = Annotated[Optional[float], typer.Option(
    help="--arch early-exit: weight of the exit losses (per block, rising with depth) beside the final loss "
         "(default 0.5).")]


def user_errors(command):
    """Turn a ReportedError (a user's mistake: exit 2; a diverged run: 3; a failed write: 1) into one red line on
    stderr and its exit code, no traceback. Any other exception is an internal failure and keeps its traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
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
