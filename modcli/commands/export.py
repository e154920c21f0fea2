"""`modcli export`: flags -> ExportConfig -> modcli.export -> validation table, op histograms, sizes."""

from __future__ import annotations

import dataclasses
from typing import Any

import typer
from rich.table import Table

import modcli
from modcli.commands import options
from modcli.commands.common import stderr, stdout, subcommand
from modcli.commands.config_flags import config_flags, source_flags
from modcli.reports.console import print_json


@subcommand
@config_flags(lambda: source_flags("bundle/config.py", "ExportConfig", leave_out=("checkpoint",)))
def export(
    checkpoint: options.Checkpoint = None,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Export a checkpoint to a validated bundle: ONNX forward (top-k) and decode-step (causal, KV cache) graphs;
    with --hf, to a Hugging Face folder that transformers loads (checked against modcli where it is installed);
    with --gguf, to one GGUF file for llama.cpp (a dense or attention-dropped model; checked before it is written)."""
    log = (lambda message: None) if json_output else (lambda message: stderr.print(message, highlight=False,
                                                                                   soft_wrap=True))
    config = modcli.ExportConfig(checkpoint, **flags)
    if config.hf:
        _hf_export(config, log, json_output)
        return
    if config.gguf:
        _gguf_export(config, log, json_output)
        return
    result = modcli.export(config, log=log)
    if json_output:
        payload = dataclasses.asdict(result)
        for check in payload["checks"]:
            if check["max_abs_diff"] == float("inf"):
                check["max_abs_diff"] = None
        print_json(payload)
    else:
        _print_report(result)
    if not result.valid:
        stderr.print(f"[red]error: validation failed, {result.bundle} is marked invalid (manifest valid=false):[/]",
                     highlight=False, soft_wrap=True)
        for failure in result.failures:
            stderr.print(f"[red]  {failure}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _hf_export(config, log, json_output: bool) -> None:
    result = modcli.export_hf(config, log=log)
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    if result.checks:
        checks = Table(title=f"{result.architecture} in transformers against modcli ({result.dtype}, atol "
                             f"{result.atol:g}, {result.routing} routing)")
        for column in ("case", "max |diff|", "tokens", "result"):
            checks.add_column(column, justify="right" if column == "max |diff|" else "left")
        for c in result.checks:
            diff = "-" if c.max_abs_diff is None else f"{c.max_abs_diff:.2e}"
            tokens = {None: "-", True: "same", False: "[red]differ[/]"}[c.tokens_match]
            checks.add_row(c.case, diff, tokens, "[green]pass[/]" if c.passed else "[red]FAIL[/]")
        stdout.print(checks)
    files = ", ".join(f"{name} ({size / 1e6:.2f} MB)" for name, size in result.files.items())
    stdout.print(f"Hugging Face folder ({result.architecture}" + (", remote code" if result.remote_code else "")
                 + f") written in {result.seconds:.1f} s: {result.folder}", highlight=False, soft_wrap=True)
    stdout.print(files, highlight=False, soft_wrap=True)


def _gguf_export(config, log, json_output: bool) -> None:
    result = modcli.export_gguf(config, log=log)
    if json_output:
        print_json(dataclasses.asdict(result))
    else:
        checks = Table(title=f"{result.architecture} GGUF file against modcli ({result.dtype} weights alike, atol "
                             f"{result.atol:g})")
        for column in ("reader", "case", "max |diff|", "result"):
            checks.add_column(column, justify="right" if column == "max |diff|" else "left")
        for c in result.checks:
            diff = "-" if c.max_abs_diff is None else f"{c.max_abs_diff:.2e}"
            checks.add_row(c.runner, c.case, diff, "[green]pass[/]" if c.passed else f"[red]FAIL[/] {c.detail}")
        stdout.print(checks)
        for note in result.notes:
            stdout.print(f"note: {note}", highlight=False, soft_wrap=True)
        if result.float32_diff is not None:
            stdout.print(f"against modcli's float32 weights: max |diff| {result.float32_diff:.2e} (what {result.dtype} "
                         "storage costs)", highlight=False, soft_wrap=True)
        if result.valid:
            stdout.print(f"GGUF file ({result.architecture}, {result.dtype}, {result.tensors} tensors, "
                         f"{result.bytes / 1e6:.2f} MB) written in {result.seconds:.1f} s: {result.file}",
                         highlight=False, soft_wrap=True)
    if not result.valid:
        failed = "; ".join(f"{c.runner}, {c.case}: " + (c.detail or f"max |diff| {c.max_abs_diff:.3g}")
                           for c in result.checks if not c.passed)
        stderr.print(f"[red]error: the GGUF file differs from modcli, nothing written to {result.file}: {failed}[/]",
                     highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _print_report(result) -> None:
    checks = Table(title=f"validation against eager PyTorch ({result.dtype}, atol {result.atol:g}; decode: prompt "
                         "+N greedy steps)")
    for column in ("graph", "runner", "case", "max |diff|", "selection", "tokens", "result"):
        checks.add_column(column, justify="right" if column == "max |diff|" else "left")
    for c in result.checks:
        mark = {None: "-", True: "same", False: "[red]differ[/]"}
        checks.add_row(c.graph, c.runner, c.case, f"{c.max_abs_diff:.2e}", mark[c.indices_match], mark[c.tokens_match],
                       "[yellow]ambiguous[/]" if c.ambiguous else "[green]pass[/]" if c.passed else "[red]FAIL[/]")
    stdout.print(checks)
    for c in result.checks:
        if c.ambiguous:
            stdout.print(f"[yellow]ambiguous[/] {c.graph} on {c.runner}, {c.case}: {c.detail}", highlight=False,
                         soft_wrap=True)
    files = Table(title=f"bundle {result.bundle}")
    for column in ("graph", "kind", "file", "size", "seconds"):
        files.add_column(column, justify="right" if column in ("size", "seconds") else "left")
    for f in result.files:
        files.add_row(f.graph, f.kind, f.file, f"{f.bytes / 1e6:.2f} MB", f"{f.seconds:.1f}")
    stdout.print(files)
    for f in result.files:
        if f.op_histogram:
            ops = ", ".join(f"{op} {count}" for op, count in f.op_histogram.items())
            stdout.print(f"[bold]{f.file}[/] ({sum(f.op_histogram.values())} nodes): {ops}", highlight=False,
                         soft_wrap=True)
    stdout.print(f"{'valid' if result.valid else 'INVALID'} bundle written in {result.seconds:.1f} s: {result.bundle}",
                 highlight=False)
