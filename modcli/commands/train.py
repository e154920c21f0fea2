"""`modcli train`: flags -> RunConfig (modcli.resolve_run_config) -> modcli.train -> summary table."""

from __future__ import annotations

import dataclasses
import shlex
import textwrap
from pathlib import Path

import typer

import modcli
from modcli.commands import options
from modcli.commands.common import is_main_process, stderr, stdout, subcommand
from modcli.config import SHAPE_FIELDS, TrainConfig
from modcli.errors import UserError
from modcli.reports.console import human, key_value_table, print_json

NOT_RUN_FLAGS = ("preset", "config", "json_output")
"""Parameters of `train` that choose where the run config starts or how it is printed, not one of its fields."""


@subcommand
def train(
    ctx: typer.Context,
    preset: options.Preset = None,
    config: options.ConfigFile = None,
    data: options.Data = None,
    tokenizer: options.Tokenizer = None,
    vocab_size: options.VocabSize = None,
    glob: options.Glob = None,
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
    hash_table: options.HashTable = None,
    attention_score: options.AttentionScore = None,
    arch: options.Arch = None,
    layer_dropout_max: options.LayerDropoutMax = None,
    exit_loss_scale: options.ExitLossScale = None,
    recursions: options.Recursions = None,
    recursion_capacities: options.RecursionCapacities = None,
    recursion_update: options.RecursionUpdate = None,
    recursion_alpha: options.RecursionAlpha = None,
    dropout: options.Dropout = None,
    dense: options.Dense = None,
    d_model: options.DModel = None,
    n_layers: options.NLayers = None,
    n_heads: options.NHeads = None,
    seq_len: options.SeqLen = None,
    batch_size: options.BatchSize = None,
    grad_accum: options.GradAccum = None,
    lr: options.Lr = None,
    warmup: options.Warmup = None,
    max_steps: options.MaxSteps = None,
    flops_budget: options.FlopsBudget = None,
    router_aux_weight: options.RouterAuxWeight = None,
    expert_aux_weight: options.ExpertAuxWeight = None,
    expert_aux_sum: options.ExpertAuxSum = None,
    expert_capacity_warmup: options.ExpertCapacityWarmup = None,
    router_lr_scale: options.RouterLrScale = None,
    expert_gate_lr_scale: options.ExpertGateLrScale = None,
    capacity_warmup: options.CapacityWarmup = None,
    eval_every: options.EvalEvery = None,
    eval_batches: options.EvalBatches = None,
    log_every: options.LogEvery = None,
    seed: options.Seed = None,
    device: options.Device = None,
    dtype: options.Dtype = None,
    compile: options.Compile = None,
    out: options.TrainOut = None,
    resume: options.Resume = None,
    init_from: options.InitFrom = None,
    trainable: options.Trainable = None,
    calibrate: options.Calibrate = None,
    objective: options.Objective = None,
    keep: options.Keep = None,
    parallel: options.Parallel = None,
    json_output: options.Json = False,
) -> None:
    """Train an MoD decoder (or its dense twin) on text; prints a summary table. Values come from --preset (default
    tiny), then --config, then the flags given."""
    flags = {name: value for name, value in options.given(ctx).items() if name not in NOT_RUN_FLAGS}
    base = preset or "tiny"
    if resume and preset is None and config is None:
        # Resume with the run's own configuration; flags given now still apply (and are checked).
        run_dir = Path(out or TrainConfig.out)
        found = modcli.complete_checkpoints(run_dir)
        if not found:
            raise UserError(f"--resume: no complete checkpoint in {run_dir}")
        saved = modcli.read_config(found[-1]).to_dict()
        flags = {**saved["model"], **saved["data"], **saved["train"], **flags}
        base = None
    elif init_from:
        # Convert another run: its shape and tokenizer, this run's routing and training flags.
        saved = modcli.read_config(modcli.resolve_checkpoint(init_from))
        shape = {name: getattr(saved.model, name) for name in SHAPE_FIELDS}
        flags = {**shape, "seq_len": saved.model.seq_len, "tokenizer": saved.data.tokenizer, **flags}
    run_config = modcli.resolve_run_config(preset, str(config) if config else None, flags, default_preset=base)
    if init_from and not resume and run_config.model.routed_layers():
        # A conversion starts as the model it came from: a processed token gets the block's whole update (router
        # weight of value 1, the sigmoid's gradient), so with every token processed the logits are the original's;
        # and its causal rules keep --capacity of the tokens from the first step (calibrated on the first batch).
        defaults = {name: value for name, value in (("router_weight", "unit"), ("calibrate", True))
                    if name not in flags}
        if defaults:
            run_config = modcli.resolve_run_config(preset, str(config) if config else None, {**flags, **defaults},
                                                   default_preset=base)
    result = modcli.train(run_config, quiet=False)
    if not is_main_process():
        return
    if json_output:
        print_json(dataclasses.asdict(result))
        return
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
    if result.expert_dropped_mean is not None:
        validation.append(("expert choices dropped (mean / max step)",
                           f"{result.expert_dropped_mean:.2%} / {result.expert_dropped_max:.2%}"))
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
    stderr.print(next_commands(run_config.train.out, run_config.model.seq_len, routed=not result.dense),
                 highlight=False, soft_wrap=True, markup=False)


def next_commands(run: str, seq_len: int, routed: bool) -> str:
    """What to run on the run just trained (stderr, after the summary), with its path as given to --out. Without a
    CHECKPOINT, eval, generate, export and routes read runs/latest, where train writes without --out."""
    run = shlex.quote(run)
    new_tokens = max(16, min(200, seq_len - 28))  # prompt + new tokens within the context the model was trained on
    lines = [f"modcli eval {run}", f'modcli generate {run} --prompt "def " --max-new-tokens {new_tokens} --temperature 0.6',
             f"modcli plot {run} --out curves.png"]
    if routed:
        # any text at hand: a README where there is one, else a file of the standard library
        text = "README.md" if Path("README.md").is_file() else shlex.quote(textwrap.__file__)
        lines.append(f"modcli routes {run} --text {text} --out routes.png")
    lines.append(f"modcli export {run}")
    return "next:\n" + "\n".join(f"  {line}" for line in lines)
