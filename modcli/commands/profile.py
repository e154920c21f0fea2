"""`modcli profile`: flags -> ProfileConfig -> modcli.profile -> one table per sequence length."""

from __future__ import annotations

import dataclasses

import typer
from rich.console import Console

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.profiling.report import tables
from modcli.reports.console import print_json

MODEL_FIELDS = frozenset(field.name for field in dataclasses.fields(ModelConfig)) - {"seq_len"}
"""The flags that shape a fresh model; profile's --seq-len is the length measured, not the model's context."""


@subcommand
def profile(
    ctx: typer.Context,
    checkpoint: options.FreshOrCheckpoint = None,
    compare: options.Compare = None,
    preset: options.Preset = None,
    config: options.ConfigFile = None,
    d_model: options.DModel = None,
    n_layers: options.NLayers = None,
    n_heads: options.NHeads = None,
    mlp_hidden: options.MlpHidden = None,
    vocab_size: options.VocabSize = None,
    capacity: options.Capacity = None,
    route_every: options.RouteEvery = None,
    route_offset: options.RouteOffset = None,
    route_layers: options.RouteLayers = None,
    router: options.Router = None,
    router_weight: options.RouterWeight = None,
    router_hidden: options.RouterHidden = None,
    threshold: options.Threshold = None,
    capacity_max: options.CapacityMax = None,
    route_part: options.RoutePart = None,
    predictor_hidden: options.PredictorHidden = None,
    keep_first: options.KeepFirst = None,
    experts: options.Experts = None,
    expert_top_k: options.ExpertTopK = None,
    expert_capacity_factor: options.ExpertCapacityFactor = None,
    noop_experts: options.NoopExperts = None,
    expert_weight: options.ExpertWeight = None,
    expert_routing: options.ExpertRouting = None,
    attention_score: options.AttentionScore = None,
    arch: options.Arch = None,
    layer_dropout_max: options.LayerDropoutMax = None,
    exit_loss_scale: options.ExitLossScale = None,
    recursions: options.Recursions = None,
    recursion_capacities: options.RecursionCapacities = None,
    recursion_update: options.RecursionUpdate = None,
    recursion_alpha: options.RecursionAlpha = None,
    seq_len: options.SeqLen = None,
    seq_lens: options.SeqLens = None,
    batch_size: options.BatchSize = None,
    repeats: options.Repeats = None,
    warmup: options.Warmup = None,
    measure: options.Measure = None,
    decode_tokens: options.DecodeTokens = None,
    routing: options.Routing = None,
    memory: options.Memory = None,
    seed: options.Seed = None,
    plot: options.Plot = None,
    onnx: options.OnnxBundles = None,
    device: options.Device = None,
    dtype: options.Dtype = None,
    backends: options.Backends = None,
    compile: options.Compile = None,
    packed_linears: options.PackedLinears = None,
    json_output: options.Json = False,
) -> None:
    """FLOPs, latency, tokens/s, peak memory and KV-cache bytes of an MoD model against its dense twin (or a
    checkpoint). Without CHECKPOINT, a freshly initialised model of --preset (default small), --config and the model
    flags."""
    values = options.given(ctx)
    model_flags = {name: value for name, value in values.items() if name in MODEL_FIELDS}
    model = None
    if checkpoint is None or model_flags or preset or config:
        model = modcli.resolve_run_config(preset, str(config) if config else None, model_flags,
                                          default_preset="small").model
    if seq_len is not None and seq_lens is not None:
        raise UserError("give --seq-len or --seq-lens, not both")
    lengths = [seq_len] if seq_len is not None else (_int_list(seq_lens, "--seq-lens") if seq_lens else None)
    result = modcli.profile(options.build(modcli.ProfileConfig, {
        **values, "model": model, "seq_lens": lengths,
        "measure": _text_list(measure) if measure is not None else None,
        "backends": _text_list(backends) if backends is not None else None}))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    out = stdout if stdout.is_terminal else Console(width=120)  # a pipe or file gets whole rows, not 80 columns
    for table in tables(result):
        out.print(table)
    out.print(f"[dim]{result.flops_note}\n{result.memory_method}[/]", highlight=False)


def _text_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None
