"""`modcli train`: flags -> RunConfig -> modcli.training.loop.train -> summary table."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from modcli.commands.common import (
    Arch,
    Capacity,
    CapacityMax,
    ExitLossScale,
    ExpertCapacityFactor,
    Experts,
    ExpertTopK,
    Json,
    LayerDropoutMax,
    NoopExperts,
    PredictorHidden,
    RecursionCapacities,
    Recursions,
    RouteEvery,
    RouteLayers,
    RouteOffset,
    RoutePart,
    Router,
    RouterHidden,
    RouterWeight,
    Threshold,
    is_main_process,
    stdout,
    user_errors,
)
from modcli.errors import UserError


@user_errors
def train(
    preset: Annotated[Optional[str], typer.Option(help="tiny, small or base (default tiny).")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="TOML file with the same keys as the flags; flags win.")] = None,
    data: Annotated[Optional[str], typer.Option(help="Text file, folder or .bin; default: the Python stdlib.")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        help="bytes (default) or a tokenizer.json (e.g. from `modcli tokenizer train`); set --vocab-size to match.")
    ] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Vocabulary size (256 for bytes).")] = None,
    glob: Annotated[Optional[str], typer.Option(help="File pattern when --data is a folder.")] = None,
    capacity: Capacity = None,
    route_every: RouteEvery = None,
    route_offset: RouteOffset = None,
    route_layers: RouteLayers = None,
    router: Router = None,
    router_weight: RouterWeight = None,
    router_hidden: RouterHidden = None,
    threshold: Threshold = None,
    capacity_max: CapacityMax = None,
    route_part: RoutePart = None,
    predictor_hidden: PredictorHidden = None,
    experts: Experts = None,
    expert_top_k: ExpertTopK = None,
    expert_capacity_factor: ExpertCapacityFactor = None,
    noop_experts: NoopExperts = None,
    arch: Arch = None,
    layer_dropout_max: LayerDropoutMax = None,
    exit_loss_scale: ExitLossScale = None,
    recursions: Recursions = None,
    recursion_capacities: RecursionCapacities = None,
    dropout: Annotated[Optional[float], typer.Option(help="Dropout on attention and block deltas (training).")] = None,
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
    router_aux_weight: Annotated[Optional[float], typer.Option(
        help="Weight of the router's auxiliary loss (topk: BCE; threshold: capacity regulariser).")] = None,
    expert_aux_weight: Annotated[Optional[float], typer.Option(
        help="Weight of the MoE load-balancing loss (default 0.01).")] = None,
    router_lr_scale: Annotated[Optional[float], typer.Option(help="Router learning rate relative to --lr.")] = None,
    capacity_warmup: Annotated[Optional[int], typer.Option(
        help="Anneal the capacity from 1.0 to --capacity over N steps.")] = None,
    eval_every: Annotated[Optional[int], typer.Option(help="Evaluate and checkpoint every N steps.")] = None,
    eval_batches: Annotated[Optional[int], typer.Option(help="Validation batches per evaluation.")] = None,
    log_every: Annotated[Optional[int], typer.Option(help="Plain progress line every N steps.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Random seed.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or mps.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16 or float16 (autocast).")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile", help="torch.compile the model.")] = None,
    out: Annotated[Optional[str], typer.Option(help="Run folder.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in --out.")] = False,
    init_from: Annotated[Optional[str], typer.Option(
        help="Start from this run's weights and tokenizer (e.g. `modcli import`'s) and convert it with the routing "
             "flags.")] = None,
    trainable: Annotated[Optional[str], typer.Option(
        help="Which parameters train: all, routers or routers+norms (the rest frozen).")] = None,
    keep: Annotated[Optional[int], typer.Option(help="Keep the newest N checkpoints.")] = None,
    parallel: Annotated[Optional[str], typer.Option(help="Under torchrun: ddp or fsdp (FSDP2).")] = None,
    json_output: Json = False,
) -> None:
    """Train an MoD decoder (or its dense twin) on text; prints a summary table."""
    flags = {k: v for k, v in locals().items()
             if k not in ("preset", "config", "resume", "json_output") and v is not None}
    from modcli.config import RunConfig, resolve_run_config
    from modcli.training.loop import train as run_training

    base = preset or "tiny"
    if resume and preset is None and config is None:
        # Resume with the run's own configuration; flags given now still apply (and are checked).
        from modcli.checkpoint.store import complete_checkpoints, read_config
        run_dir = Path(out or RunConfig().train.out)
        found = complete_checkpoints(run_dir)
        if not found:
            raise UserError(f"--resume: no complete checkpoint in {run_dir}")
        saved = read_config(found[-1]).to_dict()
        flags = {**saved["model"], **saved["data"], **saved["train"], **flags}
        base = None
    elif init_from:
        # Convert another run: its shape and tokenizer, this run's routing and training flags.
        from modcli.checkpoint.store import read_config, resolve_checkpoint
        from modcli.config import SHAPE_FIELDS
        saved = read_config(resolve_checkpoint(init_from))
        shape = {name: getattr(saved.model, name) for name in SHAPE_FIELDS}
        flags = {**shape, "seq_len": saved.model.seq_len, "tokenizer": saved.data.tokenizer, **flags}
    run_config = resolve_run_config(base, str(config) if config else None, {**flags, "resume": resume})
    result = run_training(run_config, quiet=False)
    if not is_main_process():
        return
    if json_output:
        from modcli.reports.console import print_json
        print_json(dataclasses.asdict(result))
        return
    from modcli.reports.console import human, key_value_table
    if result.dense:
        validation = [("validation loss", f"{result.val_loss:.4f}"),
                      ("validation bits/byte", f"{result.val_bits_per_byte:.4f}")]
    else:  # the causal losses first: a full-sequence mode (top-k) sees later tokens, so its loss is a reference only
        validation = [(f"validation loss (causal, {result.val_routing})", f"{result.val_loss:.4f}"),
                      (f"validation bits/byte (causal, {result.val_routing})", f"{result.val_bits_per_byte:.4f}")]
        for mode, loss in result.val_losses.items():
            if mode == result.val_routing:
                continue
            label = "causal" if result.val_causal[mode] else "non-causal reference"
            validation.append((f"validation loss ({mode}, {label})", f"{loss:.4f}"))
    if result.init_val_loss is not None:
        validation.append(("validation loss of the --init-from model", f"{result.init_val_loss:.4f}"))
    title = f"training summary ({run_config.model.kind})"
    stdout.print(key_value_table(title, [
        ("steps", str(result.steps)),
        ("parameters", f"{result.parameters:,}"),
        ("train loss", f"{result.train_loss:.4f}"),
        *validation,
        ("tokens", f"{result.tokens:,}"),
        ("training FLOPs", human(result.flops)),
        ("wall time", f"{result.wall_time_s:.1f} s"),
        ("tokens/s", f"{result.tokens_per_s:,.0f}"),
        ("checkpoint", result.checkpoint),
    ]))
