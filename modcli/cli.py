"""The command line. It only parses flags and prints results; the work is done by library functions."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from modcli.errors import TrainingDiverged, UserError

app = typer.Typer(
    help="Mixture-of-Depths decoders: train, evaluate, generate, profile.",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
)
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
            stderr.print(f"[red]error: {exc}[/]", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper


@app.command()
@user_errors
def train(
    preset: Annotated[Optional[str], typer.Option(help="tiny, small or base (default tiny).")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="TOML file with the same keys as the flags; flags win.")] = None,
    data: Annotated[Optional[str], typer.Option(help="Text file, folder or .bin; default: the Python stdlib.")] = None,
    glob: Annotated[Optional[str], typer.Option(help="File pattern when --data is a folder.")] = None,
    capacity: Annotated[Optional[float], typer.Option(help="Fraction of tokens a routed block processes.")] = None,
    route_every: Annotated[Optional[int], typer.Option(help="Route every N-th block (2 = every other).")] = None,
    route_offset: Annotated[Optional[int], typer.Option(help="Index of the first routed block.")] = None,
    router_weight: Annotated[Optional[str], typer.Option(help="sigmoid, identity or none.")] = None,
    predictor_hidden: Annotated[Optional[int], typer.Option(help="Causal predictor width (0 = none).")] = None,
    dense: Annotated[Optional[bool], typer.Option("--dense", help="Train the dense twin (routing off).")] = None,
    d_model: Annotated[Optional[int], typer.Option(help="Model width.")] = None,
    n_layers: Annotated[Optional[int], typer.Option(help="Number of blocks.")] = None,
    n_heads: Annotated[Optional[int], typer.Option(help="Attention heads.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Context length.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per micro-batch.")] = None,
    grad_accum: Annotated[Optional[int], typer.Option(help="Micro-batches per step.")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Peak learning rate.")] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Warm-up steps.")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Optimiser steps.")] = None,
    flops_budget: Annotated[Optional[float], typer.Option(
        help="Stop after this many training FLOPs (overrides --max-steps).")] = None,
    router_aux_weight: Annotated[Optional[float], typer.Option(help="Weight of the router's auxiliary BCE loss.")] = None,
    eval_every: Annotated[Optional[int], typer.Option(help="Evaluate and checkpoint every N steps.")] = None,
    eval_batches: Annotated[Optional[int], typer.Option(help="Validation batches per evaluation.")] = None,
    log_every: Annotated[Optional[int], typer.Option(help="Plain progress line every N steps.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Random seed.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or mps.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16 or float16 (autocast).")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile", help="torch.compile the model.")] = None,
    out: Annotated[Optional[str], typer.Option(help="Run folder.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in --out.")] = False,
    keep: Annotated[Optional[int], typer.Option(help="Keep the newest N checkpoints.")] = None,
    json_output: Json = False,
) -> None:
    """Train an MoD decoder (or its dense twin) on text; prints a summary table."""
    flags = {k: v for k, v in locals().items()
             if k not in ("preset", "config", "resume", "json_output") and v is not None}
    from modcli.config import RunConfig, resolve_run_config
    from modcli.train import train as run_training

    base = preset or "tiny"
    if resume and preset is None and config is None:
        # Resume with the run's own configuration; flags given now still apply (and are checked).
        from modcli.checkpoint import complete_checkpoints, read_config
        run_dir = Path(out or RunConfig().train.out)
        found = complete_checkpoints(run_dir)
        if not found:
            raise UserError(f"--resume: no complete checkpoint in {run_dir}")
        saved = read_config(found[-1]).to_dict()
        flags = {**saved["model"], **saved["data"], **saved["train"], **flags}
        base = None
    run_config = resolve_run_config(base, str(config) if config else None, {**flags, "resume": resume})
    result = run_training(run_config, quiet=False)
    if json_output:
        from modcli.reporting import print_json
        print_json(dataclasses.asdict(result))
        return
    from modcli.reporting import human, key_value_table
    stdout.print(key_value_table("training summary" + (" (dense)" if result.dense else " (MoD)"), [
        ("steps", str(result.steps)),
        ("parameters", f"{result.parameters:,}"),
        ("train loss", f"{result.train_loss:.4f}"),
        ("validation loss", f"{result.val_loss:.4f}"),
        ("validation bits/byte", f"{result.val_bits_per_byte:.4f}"),
        ("tokens", f"{result.tokens:,}"),
        ("training FLOPs", human(result.flops)),
        ("wall time", f"{result.wall_time_s:.1f} s"),
        ("tokens/s", f"{result.tokens_per_s:,.0f}"),
        ("checkpoint", result.checkpoint),
    ]))


@app.command("eval")
@user_errors
def eval_command(
    checkpoint: Annotated[str, typer.Argument(help="Run folder (newest checkpoint) or checkpoint folder.")],
    data: Annotated[Optional[str], typer.Option(help="Evaluate on this corpus instead of the training one.")] = None,
    glob: Annotated[str, typer.Option(help="File pattern when --data is a folder.")] = "**/*",
    routing: Annotated[Optional[list[str]], typer.Option(help="topk, router, predictor (repeat; default all).")] = None,
    batches: Annotated[int, typer.Option(help="Validation batches.")] = 16,
    batch_size: Annotated[int, typer.Option(help="Sequences per batch.")] = 8,
    device: Device = "auto",
    dtype: Dtype = "float32",
    json_output: Json = False,
) -> None:
    """Validation loss, bits per byte and perplexity under each routing mode (topk is non-causal)."""
    from rich.table import Table

    from modcli.config import ROUTING_MODES
    from modcli.evaluate import EvalConfig, evaluate

    result = evaluate(EvalConfig(checkpoint=checkpoint, data=data, glob=glob,
                                 routing=routing or list(ROUTING_MODES), batches=batches,
                                 batch_size=batch_size, device=device, dtype=dtype))
    if json_output:
        from modcli.reporting import print_json
        print_json(dataclasses.asdict(result))
        return
    table = Table(title=f"{result.checkpoint} on {result.corpus} ({result.tokens:,} tokens)")
    for column in ("routing", "causal", "loss", "bits/byte", "perplexity", "processed per routed block"):
        table.add_column(column, justify="left" if column in ("routing", "processed per routed block") else "right")
    for r in result.results:
        label = r.routing + (" (non-causal, reference only)" if not r.causal else "")
        fractions = " ".join(f"{k}={v:.3f}" for k, v in r.processed_fraction.items()) or "-"
        table.add_row(label, "yes" if r.causal else "no", f"{r.loss:.4f}", f"{r.bits_per_byte:.4f}",
                      f"{r.perplexity:.3f}", fractions)
    stdout.print(table)
    if result.agreement:
        agree = Table(title="causal rules against top-k (per routed block)")
        for column in ("block", "rule", "accuracy", "precision", "recall", "processed"):
            agree.add_column(column, justify="right")
        for block, rules in result.agreement.items():
            for rule, s in rules.items():
                agree.add_row(block, rule, f"{s['accuracy']:.3f}", f"{s['precision']:.3f}", f"{s['recall']:.3f}",
                              f"{s['processed_fraction']:.3f}")
        stdout.print(agree)


@app.command()
@user_errors
def generate(
    checkpoint: Annotated[str, typer.Argument(help="Run folder (newest checkpoint) or checkpoint folder.")],
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt text (repeat for a batch).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Bytes to generate per prompt.")] = 200,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely bytes (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling threshold (1 = off).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampler seed.")] = 1337,
    routing: Annotated[str, typer.Option(help="Causal routing: router or predictor.")] = "router",
    device: Device = "auto",
    dtype: Dtype = "float32",
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile attention and MLP.")] = False,
    json_output: Json = False,
) -> None:
    """Generate text with causal routing and a KV cache holding only the tokens each block processed."""
    from modcli.generate import GenerateConfig, Utf8Stream
    from modcli.generate import generate as run_generation

    config = GenerateConfig(checkpoint=checkpoint, prompts=prompt or ["def "], max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, routing=routing,
                            device=device, dtype=dtype, compile=compile)
    stream = None
    if not json_output and len(config.prompts) == 1:
        sys.stdout.write(config.prompts[0])
        writer = Utf8Stream(lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        stream = writer
    result = run_generation(config, on_bytes=stream)
    if json_output:
        from modcli.reporting import print_json
        print_json(dataclasses.asdict(result))
        return
    if stream is None:
        for prompt_text, text in zip(config.prompts, result.texts, strict=True):
            sys.stdout.write(f"{prompt_text}{text}\n---\n")
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    saving = 1 - result.kv_cache_bytes / max(1, result.dense_kv_cache_bytes)
    fractions = " ".join(f"{k}={v:.3f}" for k, v in result.processed_fraction.items()) or "dense"
    stderr.print(f"{result.new_tokens} tokens, {result.tokens_per_s:.1f} tokens/s (prefill {result.prefill_s:.3f}s, "
                 f"decode {result.decode_s:.3f}s), routing {result.routing}, processed {fractions}, KV cache "
                 f"{result.kv_cache_bytes:,} bytes vs dense {result.dense_kv_cache_bytes:,} ({saving:.1%} saved)",
                 highlight=False, soft_wrap=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
