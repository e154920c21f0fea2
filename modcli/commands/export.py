"""`modcli export`: flags -> ExportConfig -> modcli.bundle.writer.export -> validation table, op histograms, sizes."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer

from modcli.commands.common import Json, stderr, stdout, user_errors


@user_errors
def export(
    checkpoint: Annotated[str, typer.Argument(help="Run folder (newest checkpoint) or checkpoint folder.")],
    out: Annotated[str, typer.Option(help="Bundle folder to write.")] = "bundles/latest",
    onnx: Annotated[bool, typer.Option("--onnx/--no-onnx", help="Export ONNX graphs (what modcli-run runs).")] = True,
    compile: Annotated[bool, typer.Option(
        "--compile", help="Also write torch.export .pt2 programs and AOTInductor packages (slow: a C++ compile).")] = False,
    graph: Annotated[Optional[list[str]], typer.Option(
        help="forward (top-k, non-causal) and/or decode (causal, KV cache); repeat; default both.")] = None,
    routing: Annotated[Optional[str], typer.Option(
        help="Causal routing of the decode graph (topk router: router or predictor); default the router's first.")] = None,
    dtype: Annotated[str, typer.Option(
        help="Weights and activations of the graphs: float32, float16 (bfloat16 only with --no-onnx --compile).")
    ] = "float32",
    provider: Annotated[str, typer.Option(help="onnxruntime provider to validate on: auto, cpu or cuda.")] = "auto",
    opset: Annotated[int, typer.Option(help="ONNX opset (>= 18).")] = 18,
    atol: Annotated[Optional[float], typer.Option(
        help="Largest |logit difference| against eager PyTorch (default 1e-4 for float32).")] = None,
    decode_steps: Annotated[int, typer.Option(help="Greedy steps compared with modcli generate.")] = 16,
    text: Annotated[Optional[str], typer.Option(help="Text file for the real-text checks (default: stdlib textwrap.py).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random validation tokens.")] = 1337,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing bundle at --out.")] = False,
    json_output: Json = False,
) -> None:
    """Export a checkpoint to a validated bundle: ONNX forward (top-k) and decode-step (causal, KV cache) graphs."""
    from modcli.bundle.writer import ExportConfig
    from modcli.bundle.writer import export as run_export

    config = ExportConfig(checkpoint=checkpoint, out=out, onnx=onnx, compile=compile,
                          graphs=graph or ["forward", "decode"], routing=routing, dtype=dtype, provider=provider,
                          opset=opset, atol=atol, decode_steps=decode_steps, text=text, seed=seed, force=force)
    log = (lambda message: None) if json_output else (lambda message: stderr.print(message, highlight=False))
    result = run_export(config, log=log)
    if json_output:
        from modcli.reports.console import print_json

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


def _print_report(result) -> None:
    from rich.table import Table

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
