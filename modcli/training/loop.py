"""`modcli train`: AdamW with warm-up and cosine decay, checkpoints, resume, metrics and a FLOP budget.

Runs as one process, or under `torchrun` as DDP / FSDP2 (see modcli/training/distributed.py); rank 0 alone prints,
writes metrics and writes checkpoints.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from modcli.checkpoint.lock import OutLock
from modcli.checkpoint.store import (
    check_config_values,
    check_weights_file,
    clean_stale,
    complete_checkpoints,
    load_model_from,
    load_weights,
    read_config,
    read_optimizer_state,
    read_state,
    read_tensors,
    refuse_foreign_folder,
    resolve_checkpoint,
    save_checkpoint,
)
from modcli.compiling import CompileStats, compile_module, graph_break_counts
from modcli.config import SHAPE_FIELDS, ModelConfig, RunConfig, TrainConfig
from modcli.config.drops import parse_block_list
from modcli.data.corpus import BatchSampler, Corpus, evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer
from modcli.errors import TrainingDiverged, UserError, WriteFailed
from modcli.hardware import autocast, seed_everything
from modcli.models.build import build_model
from modcli.models.decoder import MoDDecoder, dropped_weight
from modcli.models.moe import balance_hash_tables
from modcli.models.routing.calibration import calibrate_causal_rules
from modcli.reports.console import MetricsLog, StepProgress, read_metrics_file, stderr_console
from modcli.training import distributed
from modcli.training.distributed import DistributedContext
from modcli.training.lora import (
    ADAPTERS_FILE,
    adapter_state,
    add_adapters,
    is_adapter_parameter,
    load_adapters,
    merged_state,
    parse_targets,
)
from modcli.training.objective import (
    Objective,
    bits_per_byte,
    check_objective,
    lm_loss,
    routing_agreement,
    training_loss,
)
from modcli.training.resume import check_resumable, gather_resume_state, restore_resume_state
from modcli.training.schedule import (
    capacity_at,
    expert_capacity_factor_at,
    learning_rate,
    make_optimizer,
    router_parameter_names,
    step_flops,
    total_steps,
)

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
NAN_AT_STEP_ENV = "MODCLI_TEST_NAN_AT_STEP"
"""Test hook, read from the environment only: the training loss of this step (from 1) is made NaN, as a diverging
run's would be (tests/test_reliability.py)."""
RESUME_KEYS = ("step", "tokens", "flops", "elapsed_s", "sampler")


@dataclass
class TrainResult:
    """What a training run achieved; `modcli train` prints it as the summary table.

    The validation losses are those of the evaluation records in metrics.jsonl (`val_loss`, `val_bits_per_byte`,
    and `val_loss_<mode>` per routing mode). A full-sequence mode such as top-k selects a token by comparing it
    with later tokens, so its loss sees the future; `val_loss` is therefore the causal number. A dense run has only
    `val_loss` and `val_bits_per_byte` (`val_losses` is empty).
    """

    run_dir: str
    checkpoint: str
    steps: int
    train_loss: float
    val_loss: float
    """Validation loss (nats/token) under the router's first causal mode (what decoding does); for dense the only
    loss."""
    val_bits_per_byte: float
    """`val_loss` in bits per byte."""
    val_routing: str
    """The routing mode of `val_loss` ("dense" for a dense model)."""
    val_losses: dict[str, float]
    """MoD: the validation loss under each routing mode of the router, causal modes first."""
    val_causal: dict[str, bool]
    """MoD: whether each mode of `val_losses` is causal; a non-causal loss sees the future, a reference only."""
    init_val_loss: float | None
    """With --init-from: the original model's validation loss (its causal mode) on the same windows, before
    training: what a converted model is compared with."""
    tokens: int
    flops: float
    wall_time_s: float
    tokens_per_s: float
    dense: bool
    router: str | None
    """The router kind of the routed blocks (modcli.models.routing.registry); None for a dense model."""
    parameters: int
    world_size: int
    compile_s: float | None = None
    """With --compile: wall time of the first step of this session (compilation plus the step), left out of
    tokens_per_s."""
    graph_breaks: int | None = None
    """With --compile: graph breaks torch.compile met (0: the step is one graph)."""
    expert_dropped_mean: float | None = None
    """With MoE blocks: the share of real-expert choices the training capacity dropped (metrics.jsonl's
    `expert_dropped`, mean over the MoE blocks), averaged over this session's steps; None without experts."""
    expert_dropped_max: float | None = None
    """With MoE blocks: the largest `expert_dropped` of any step of this session (a collapse in the first tens of
    steps shows here, not in the last step's value)."""
    calibration: dict[str, dict[str, float]] | None = None
    """With --calibrate: per causal mode, per routed block, the share of the first training batch its causal rule
    processed after calibration (before the first step); None without it, on resume, or with nothing to calibrate."""


def validation_modes(model: MoDDecoder) -> list[str]:
    """Routing modes evaluated during training, causal first (e.g. router, predictor, then top-k for the topk
    router). The dense twin has no routed block, so every mode is the same model: one evaluation."""
    if model.config.dense:
        return ["dense"]
    causal = model.causal_modes()
    return [*causal, *(mode for mode in model.routing_modes() if mode not in causal)]


@torch.no_grad()
def validation_losses(model: torch.nn.Module, corpus: Corpus, config: RunConfig, context: DistributedContext,
                      modes: list[str]) -> dict[str, float]:
    """The validation keys of metrics.jsonl (see TrainResult): mean losses over the fixed validation windows of
    the global batch, each routing mode of `modes` (`validation_modes`) on the same windows; each rank evaluates
    its slice. `val_loss` is the first mode's."""
    tc, device = config.train, context.device
    model.eval()
    losses: dict[str, list[torch.Tensor]] = {mode: [] for mode in modes}
    for inputs, targets in evaluation_batches(corpus.val, config.model.seq_len, tc.batch_size * context.world_size,
                                              tc.eval_batches):
        mine = slice(context.rank * tc.batch_size, (context.rank + 1) * tc.batch_size)
        inputs, targets = inputs[mine].to(device), targets[mine].to(device)  # (b, T)
        for mode in modes:
            with autocast(device, tc.dtype):
                logits = model(inputs, mode)  # (b, T, V)
            losses[mode].append(lm_loss(logits, targets))
    model.train()
    module = getattr(model, "_orig_mod", model)
    if hasattr(module, "reshard"):  # FSDP2 keeps the root unsharded after a no-grad forward; undo that
        module.reshard()
    means = torch.stack([torch.stack(losses[mode]).mean() for mode in modes]).float()  # (modes,)
    by_mode = dict(zip(modes, distributed.mean_across_ranks(means, context).tolist(), strict=True))
    result = {"val_loss": by_mode[modes[0]],
              "val_bits_per_byte": bits_per_byte(by_mode[modes[0]], corpus.bytes_per_token)}
    if not config.model.dense:
        result.update({f"val_loss_{mode}": loss for mode, loss in by_mode.items()})
    return result


@dataclass
class _Prepared:
    """Everything a training run holds between steps."""

    corpus: Corpus
    model: MoDDecoder
    wrapped: torch.nn.Module
    optimizer: torch.optim.AdamW
    sampler: BatchSampler
    scaler: torch.amp.GradScaler
    step: int = 0
    tokens: int = 0
    flops: float = 0.0
    elapsed_before: float = 0.0
    last_checkpoint: Path | None = None
    note: str | None = None
    notes: list[str] = field(default_factory=list)
    """Lines for rank 0 to print before training (a stale lock taken over, temporary folders cleaned up)."""
    init_val_loss: float | None = None
    calibration: dict[str, dict[str, float]] | None = None
    teacher: MoDDecoder | None = None
    """The original model (--init-from), frozen, for --objective distill and block-match."""


def _prepare(config: RunConfig, context: DistributedContext) -> _Prepared:
    """Checks, data, model, optimizer and (with --resume) the newest checkpoint's state."""
    tc, mc = config.train, config.model
    check_config_values(config.to_dict())
    if not 0 <= tc.seed < 2**63:  # what numpy's and torch's generators accept
        raise UserError(f"--seed must be in [0, 2**63), got {tc.seed}")
    if tc.trainable.startswith("blocks:"):  # the model's depth is known now: a bad block fails before any work
        parse_block_list(tc.trainable.removeprefix("blocks:"), mc.n_layers, "--trainable blocks")
    run_dir = Path(tc.out)
    existing = complete_checkpoints(run_dir)
    if tc.resume and not existing:
        raise UserError(f"--resume: no complete checkpoint in {run_dir}")
    metrics_note = None
    if tc.resume and context.is_main and (run_dir / "metrics.jsonl").is_file():
        # A last line cut short by a kill is dropped (a note); a damaged line before it stops here, before any work.
        _, metrics_note = read_metrics_file(run_dir / "metrics.jsonl")
    if not tc.resume and existing:
        raise UserError(f"--out {run_dir} already holds checkpoints; pass --resume to continue or pick another --out")
    if tc.dtype == "float16" and (context.device.type == "cpu" or tc.parallel == "fsdp"):
        raise UserError("--dtype float16 needs a GPU and --parallel ddp; use bfloat16 or float32")
    if tc.compile and context.enabled and tc.parallel == "fsdp":
        raise UserError("--compile with --parallel fsdp is not supported yet; use --parallel ddp")

    init = resolve_checkpoint(tc.init_from) if tc.init_from and not tc.resume else None
    if init is not None:
        _check_init_from(read_config(init), config, init)
    tokenizer = _run_tokenizer(config, init, context)
    corpus = load_corpus(config.data, mc.seq_len, tokenizer)
    seed_everything(tc.seed)  # identical initial weights on every rank
    if tc.resume:
        _loading(lambda checkpoint: check_weights_file(checkpoint, mc), existing[-1], existing)
    model = build_model(mc)
    table_note = _balance_hash_tables(model, corpus, mc) if not tc.resume and init is None else None
    resume_state = optimizer_state = None
    init_val_loss = None
    if tc.resume:
        newest = existing[-1]
        check_resumable(_loading(read_config, newest, existing), config, newest)
        _loading(lambda checkpoint: load_weights(model, checkpoint), newest, existing)
        resume_state = _loading(_read_resume_state, newest, existing)
        optimizer_state = _loading(read_optimizer_state, newest, existing)
        init_val_loss = resume_state.get("init_val_loss")
    elif init is not None:
        original, _, _ = load_model_from(init, context.device)
        init_val_loss = validation_losses(original, corpus, config, context, validation_modes(original)[:1])["val_loss"]
        _load_for_conversion(model, original, init)
        teacher = original
    if tc.objective in ("distill", "block-match") and tc.init_from:
        if init is None:  # resumed: the original is read again
            teacher = load_model_from(resolve_checkpoint(tc.init_from), context.device)[0]
        teacher.requires_grad_(False)
    else:
        teacher = None
    if tc.trainable == "lora":
        if tc.parallel == "fsdp" and context.enabled:
            raise UserError("--trainable lora runs in one process or under --parallel ddp, not fsdp")
        add_adapters(model, tc.lora_rank, tc.lora_alpha, parse_targets(tc.lora_targets))
        if tc.resume:
            load_adapters(model, _loading(lambda checkpoint: read_tensors(checkpoint, ADAPTERS_FILE), existing[-1],
                                          existing), str(existing[-1] / ADAPTERS_FILE))
    freeze_for(model, tc.trainable)
    check_objective(model, tc, context.world_size)
    model = model.to(context.device)
    calibration = None
    if tc.calibrate and not tc.resume:
        calibration = _calibrate(model, corpus, config, context)
    wrapped = distributed.wrap_model(model, context, tc.parallel)
    optimizer = make_optimizer(model, tc)
    sampler = BatchSampler(corpus.train, mc.seq_len, tc.batch_size, tc.seed, context.rank, context.world_size)
    scaler = torch.amp.GradScaler(context.device.type, enabled=tc.dtype == "float16")
    prepared = _Prepared(corpus, model, wrapped, optimizer, sampler, scaler, init_val_loss=init_val_loss,
                         calibration=calibration, notes=[note for note in (table_note, metrics_note) if note],
                         teacher=teacher)
    torch.manual_seed(tc.seed + context.rank)  # dropout differs per rank
    if resume_state is not None:
        newest = existing[-1]
        try:
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise UserError(f"{newest / 'optimizer.pt'} does not fit this model's optimizer: "
                            f"{' '.join(str(exc).split())[:200]}") from None
        prepared.step, prepared.tokens = resume_state["step"], resume_state["tokens"]
        prepared.flops, prepared.elapsed_before = resume_state["flops"], resume_state["elapsed_s"]
        prepared.last_checkpoint = newest
        try:
            sampler.load_state(resume_state["sampler"])
            prepared.note = restore_resume_state(resume_state, scaler, context, mc.dropout)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise UserError(f"{newest / 'state.json'} is damaged: {' '.join(str(exc).split())[:200]}") from None
    return prepared


def _balance_hash_tables(model: torch.nn.Module, corpus: Corpus, mc: ModelConfig) -> str | None:
    """--hash-table balanced: the hash-routed MLPs' tables from the training split's token counts (a resumed or
    converted run keeps the table in its weights); returns the line that says what each expert got."""
    if mc.expert_routing != "hash" or mc.hash_table != "balanced":
        return None
    counts = torch.from_numpy(np.bincount(corpus.train, minlength=mc.vocab_size)[:mc.vocab_size].astype(np.int64))
    shares = balance_hash_tables(model, counts)
    return (f"hash table balanced over the {len(corpus.train):,} training tokens: the {mc.experts} experts get "
            f"{' / '.join(f'{100 * share:.1f}' for share in shares)}% of them")


def _calibrate(model: MoDDecoder, corpus: Corpus, config: RunConfig,
               context: DistributedContext) -> dict[str, dict[str, float]] | None:
    """--calibrate: the causal rules shifted to keep --capacity of the first training batch (the whole global batch,
    the same on every rank, so replicated routers stay equal); the shares processed afterwards."""
    tc, mc = config.train, config.model
    first = BatchSampler(corpus.train, mc.seq_len, tc.batch_size * context.world_size, tc.seed)
    inputs, _ = first.next()  # (B x world, T): what the run's sampler draws first, every rank's slice together
    with autocast(context.device, tc.dtype):
        return calibrate_causal_rules(model, inputs.to(context.device))


def _loading(read, checkpoint: Path, existing: list[Path]):
    """read(checkpoint) for --resume; a damaged newest checkpoint says which older one could be resumed from."""
    try:
        return read(checkpoint)
    except UserError as exc:
        if len(existing) < 2:
            raise
        raise UserError(f"--resume: {exc}; the older {existing[-2].name} may be intact: move {checkpoint.name} out "
                        "of the run folder to resume from it") from None


def _read_resume_state(checkpoint: Path) -> dict[str, Any]:
    state = read_state(checkpoint)
    missing = [key for key in RESUME_KEYS if key not in state]
    if missing:
        raise UserError(f"{checkpoint / 'state.json'} is damaged: no {', '.join(missing)}")
    return state


def lock_run_folder(run_dir: Path) -> tuple[OutLock, list[str]]:
    """Take --out's lock (modcli.checkpoint.lock: any other command writing it is refused), tidy what a killed save
    left, and refuse a non-empty folder that is not a run; returns the lock and the notes to print."""
    lock = OutLock(run_dir, "train", kind="run folder", in_place=True)
    notes = lock.acquire()
    try:
        notes += clean_stale(run_dir)
        refuse_foreign_folder(run_dir, "train")
    except OSError as exc:
        lock.release()
        raise UserError(f"--out {run_dir}: cannot clean up temporary folders: {exc.strerror or exc}") from None
    except BaseException:
        lock.release()
        raise
    return lock, notes


def _check_init_from(saved: RunConfig, config: RunConfig, checkpoint: Path) -> None:
    for name in SHAPE_FIELDS:
        mine, theirs = getattr(config.model, name), getattr(saved.model, name)
        if mine != theirs:
            raise UserError(f"--init-from: --{name.replace('_', '-')} is {mine!r} but {checkpoint} has {theirs!r}")
    if config.data.tokenizer != saved.data.tokenizer and saved.data.tokenizer != "bytes" and \
            config.data.tokenizer == "bytes":
        raise UserError(f"--init-from: {checkpoint} reads text with {saved.data.tokenizer}, this run with bytes")


def _run_tokenizer(config: RunConfig, init: Path | None, context: DistributedContext):
    """The run's tokenizer. A run keeps its tokenizer.json in its folder: one started --init-from a run with one, or
    given --tokenizer FILE, gets a copy there (and its config says "tokenizer.json")."""
    run_dir, spec = Path(config.train.out), config.data.tokenizer
    in_run = not Path(spec).is_absolute() and (run_dir / spec).is_file()  # a resumed run's own copy
    if spec != "bytes" and not in_run:
        source = init.parent / spec if init is not None else Path(spec)
        if not source.is_file():
            raise UserError(f"--tokenizer: no such file: {source}")
        if context.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, run_dir / "tokenizer.json")
        config.data.tokenizer = "tokenizer.json"
    distributed.barrier(context)
    tokenizer = load_tokenizer(config.data.tokenizer, run_dir)
    vocab = getattr(getattr(tokenizer, "tokenizer", None), "get_vocab_size", lambda: 256)()
    if vocab > config.model.vocab_size:
        raise UserError(f"the tokenizer has {vocab} tokens but the model's vocabulary is {config.model.vocab_size}")
    return tokenizer


def _load_for_conversion(model: MoDDecoder, original: MoDDecoder, checkpoint: Path) -> None:
    """The weights of `original` (the model of `checkpoint`, as loaded from it: names of older files renamed) into
    `model`, whose routers (if any) are new and keep their initialisation: the original's routers
    (`router_parameter_names`, of another kind or none) are not carried over."""
    skip = router_parameter_names(original)
    state = {name: tensor for name, tensor in original.state_dict().items() if name not in skip}
    missing, unexpected = model.load_state_dict(state, strict=False)
    routers = router_parameter_names(model)
    missing = [name for name in missing if name not in routers and name != "head.weight"]
    unexpected = [name for name in unexpected if not dropped_weight(model.config, name)]  # --drop removes them
    if missing or unexpected:
        raise UserError(f"--init-from: {checkpoint} does not fit (missing {missing}, unexpected {unexpected})")


def freeze_for(model: torch.nn.Module, trainable: str) -> None:
    """--trainable: all; routers (their parameters and predictors only: `router_parameter_names`); routers+norms
    (and the RMSNorm weights); lora (the adapters `add_adapters` put on the model, and the routers); blocks:A-B
    (those blocks' parameters, the final norm, the head (the tied embedding) and the routers). A model with nothing
    of the kind asked for to train is a UserError."""
    if trainable == "all":
        return
    routers = router_parameter_names(model)
    blocks: tuple[int, ...] = ()
    if trainable.startswith("blocks:"):
        blocks = parse_block_list(trainable.removeprefix("blocks:"), model.config.n_layers, "--trainable blocks")

    def trains(name: str) -> bool:
        if name in routers:
            return True
        if trainable == "routers+norms":
            return name.endswith("norm.weight")
        if trainable == "lora":
            return is_adapter_parameter(name)
        parts = name.split(".")
        return bool(blocks) and ((parts[0] == "blocks" and int(parts[1]) in blocks)
                                 or parts[0] in ("norm", "head") or (parts[0] == "embed" and model.config.tie_embeddings))

    for name, param in model.named_parameters():
        param.requires_grad_(trains(name))
    if not any(param.requires_grad for param in model.parameters()):
        kind = getattr(getattr(model, "config", None), "kind", "this model")
        raise UserError(f"--trainable {trainable}: the model ({kind}) has no router parameters to train; use "
                        "--trainable all, or a router with parameters")


def train(config: RunConfig, quiet: bool = False) -> TrainResult:
    """Train an MoD decoder (or its dense twin) as `config` says; returns the summary of the run."""
    context = distributed.setup(config.train.device)
    lock = None
    try:
        prepared, error, notes = None, None, []
        try:
            if context.is_main:  # rank 0 writes the run folder, so rank 0 holds its lock
                lock, notes = lock_run_folder(Path(config.train.out))
            prepared = _prepare(config, context)
            prepared.notes = [*notes, *prepared.notes]
        except UserError as exc:
            error = exc
        distributed.agree_on_errors(context, error)
        return _run(config, context, prepared, quiet or not context.is_main)
    finally:
        if lock is not None:
            lock.release()
        prepared = None  # the DDP wrapper (and its reducer) must go before its process group, or freeing it can hang
        distributed.teardown(context)


def _run(config: RunConfig, context: DistributedContext, run: _Prepared, quiet: bool) -> TrainResult:
    tc, mc = config.train, config.model
    device, run_dir = context.device, Path(tc.out)
    steps = total_steps(config, context.world_size)
    per_step_flops = step_flops(config, context.world_size)
    global_batch = tc.batch_size * tc.grad_accum * context.world_size
    compile_stats = CompileStats() if tc.compile else None
    # dynamic=None: a capacity warm-up changes k, which then becomes a symbolic size instead of a recompile per k
    forward = compile_module(run.wrapped, device, dynamic=None) if tc.compile else run.wrapped
    breaks_before = graph_break_counts()
    scaler = run.scaler
    train_mode = run.model.training_mode
    modes = validation_modes(run.model)
    metrics = MetricsLog(run_dir, resume_step=run.step if tc.resume else None) if context.is_main else None
    if not quiet:
        kind = mc.kind + (f" on blocks {mc.routed_layers()}" if mc.routed_layers() else "")
        parallel = f", {context.world_size} ranks ({tc.parallel})" if context.enabled else ""
        stderr_console.print(
            f"training {run.model.num_parameters():,} parameters ({kind}) on {run.corpus.description}, device "
            f"{device}{parallel}; {steps} steps, global batch {global_batch} = {tc.batch_size} x {tc.grad_accum} "
            f"x {context.world_size} sequences of {mc.seq_len} tokens", highlight=False)
        if run.calibration:
            shares = [share for blocks in run.calibration.values() for share in blocks.values()]
            stderr_console.print(
                f"calibrated the causal rules ({', '.join(run.calibration)}) to --capacity {mc.capacity} on the first "
                f"batch: each routed block processes {100 * min(shares):.1f}-{100 * max(shares):.1f}% of it",
                highlight=False, soft_wrap=True)
        for note in [*run.notes, run.note]:
            if note:
                stderr_console.print(note, highlight=False, soft_wrap=True)
    progress = StepProgress(steps, run.step, tc.log_every, quiet)

    session_start = time.perf_counter()
    session_tokens, train_time = 0, 0.0
    train_loss = float("nan")
    validation: dict[str, float] | None = None

    def save() -> Path | None:
        """Gather the full state and every rank's RNG states (collectives); rank 0 writes it."""
        optimizer_state = get_optimizer_state_dict(run.model, run.optimizer, options=FULL_STATE)
        model_state = get_model_state_dict(run.model, options=FULL_STATE) if context.enabled else None
        resume_state = gather_resume_state(scaler, context)
        if not context.is_main:
            return run.last_checkpoint
        to_save, tensors = run.model, None
        adapters = tc.trainable == "lora"
        if adapters:  # the adapters merged into a plain model (what every reader loads); kept apart for --resume
            model_state, tensors = merged_state(run.model), {ADAPTERS_FILE: adapter_state(run.model)}
        if model_state is not None:  # sharded or replicated across ranks, or adapted: save a plain CPU copy
            with torch.random.fork_rng(devices=[]):  # its initialisation must not move the saved RNG on
                to_save = build_model(mc)
            to_save.load_state_dict(model_state)
        state = {"step": run.step, "tokens": run.tokens, "flops": run.flops, "world_size": context.world_size,
                 "elapsed_s": run.elapsed_before + time.perf_counter() - session_start,
                 "sampler": run.sampler.state(), "init_val_loss": run.init_val_loss, **resume_state}
        return save_checkpoint(run_dir, run.step, to_save, optimizer_state, config, state, tc.keep, tensors)

    try:
        nan_at_step = int(os.environ.get(NAN_AT_STEP_ENV) or 0)
    except ValueError:
        nan_at_step = 0

    def diverged(what: str, step: int) -> str:
        kept = (f"; the last good checkpoint, {run.last_checkpoint}, is kept" if run.last_checkpoint
                else "; no checkpoint was saved before it")
        return f"training diverged: {what} at step {step}{kept}"

    run.wrapped.train()
    dropped: list[float] = []  # expert_dropped of each step of this session (MoE blocks)
    try:
        while run.step < steps:
            step_start = time.perf_counter()
            lr = learning_rate(run.step + 1, steps, tc)
            capacity = capacity_at(run.step + 1, mc, tc)
            for moe in run.model.moe_blocks():  # --expert-capacity-warmup: no capacity limit at first
                moe.capacity_factor = expert_capacity_factor_at(run.step + 1, mc, tc)
            make_nan = nan_at_step == run.step + 1
            train_loss, grad_norm, objective = _optimizer_step(run, forward, tc, context, lr, capacity, train_mode,
                                                               make_nan, diverged)
            run.step += 1
            if objective.aux.experts:
                dropped.append(expert_dropped(objective))
            step_tokens = global_batch * mc.seq_len
            run.tokens += step_tokens
            session_tokens += step_tokens
            run.flops += per_step_flops if run.step > tc.expert_capacity_warmup else step_flops(
                config, context.world_size, run.step)
            train_time += time.perf_counter() - step_start
            if compile_stats is not None and not compile_stats.compile_s:  # the first step compiled the graphs
                compile_stats.compile_s = time.perf_counter() - step_start
                compile_stats.count_breaks_since(breaks_before)
                train_time, session_tokens = 0.0, 0
                if not quiet:
                    stderr_console.print(f"torch.compile: {compile_stats.describe()} (the first step; left out of "
                                         "tokens/s)", highlight=False, soft_wrap=True)

            last_step = run.step == steps or bool(tc.flops_budget and run.flops >= tc.flops_budget)
            evaluate_now = run.step % tc.eval_every == 0 or last_step
            record = {"step": run.step, "loss": train_loss, "lr": lr,
                      **({"compile_s": compile_stats.compile_s} if compile_stats and session_tokens == 0 else {}),
                      "grad_norm": grad_norm,
                      "tokens": run.tokens, "flops": run.flops,
                      "elapsed_s": run.elapsed_before + time.perf_counter() - session_start,
                      "tokens_per_s": session_tokens / max(train_time, 1e-9),
                      **_objective_metrics(objective, capacity if tc.capacity_warmup else None,
                                           detailed=run.step % tc.log_every == 0 or last_step),
                      **({"expert_dropped": dropped[-1]} if objective.aux.experts else {})}
            if evaluate_now:
                validation = validation_losses(forward, run.corpus, config, context, modes)
                record.update(validation)
                broken = next((key for key, value in validation.items() if not math.isfinite(value)), None)
                if broken is not None:
                    raise TrainingDiverged(diverged(f"the validation loss ({broken}) became {validation[broken]}",
                                                    run.step))
            if metrics is not None:
                try:
                    metrics.write(record)
                except OSError as exc:
                    raise WriteFailed(f"cannot write {metrics.path}: {exc.strerror or exc}") from None
            progress.update(run.step, f"loss {train_loss:.3f} tok/s {record['tokens_per_s']:.0f}")
            if evaluate_now:
                error = None
                try:
                    run.last_checkpoint = save()
                except WriteFailed as exc:
                    error = exc
                distributed.agree_on_errors(context, error)  # every rank stops, none waits in a collective
            if last_step:
                break
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()

    if steps == 0 and run.last_checkpoint is None:  # --init-from --max-steps 0: the converted model as it starts
        run.last_checkpoint = save()
    if validation is None:  # nothing left to train (resumed at the end): evaluate what is there
        validation = validation_losses(forward, run.corpus, config, context, modes)
    caps = run.model.capabilities
    return TrainResult(
        run_dir=str(run_dir), checkpoint=str(run.last_checkpoint), steps=run.step, train_loss=train_loss,
        val_loss=validation["val_loss"], val_bits_per_byte=validation["val_bits_per_byte"], val_routing=modes[0],
        val_losses={mode: validation[f"val_loss_{mode}"] for mode in modes if f"val_loss_{mode}" in validation},
        val_causal={mode: caps.is_causal(mode) for mode in modes} if caps else {}, init_val_loss=run.init_val_loss,
        tokens=run.tokens, flops=run.flops,
        wall_time_s=run.elapsed_before + time.perf_counter() - session_start,
        tokens_per_s=session_tokens / max(train_time, 1e-9), dense=mc.dense, router=None if mc.dense else mc.router,
        parameters=run.model.num_parameters(), world_size=context.world_size,
        compile_s=compile_stats.compile_s if compile_stats else None,
        graph_breaks=compile_stats.graph_breaks if compile_stats else None,
        expert_dropped_mean=sum(dropped) / len(dropped) if dropped else None,
        expert_dropped_max=max(dropped) if dropped else None, calibration=run.calibration,
    )


def _optimizer_step(run: _Prepared, forward, tc: TrainConfig, context: DistributedContext, lr: float,
                    capacity: float, train_mode: str, make_nan: bool, diverged):
    """One optimiser step over --grad-accum micro-batches: the objective, backward, gradient clipping, AdamW.
    Returns (the mean LM loss across ranks, the gradient norm, the last micro-batch's Objective); a non-finite
    loss or gradient norm raises TrainingDiverged (`diverged(what, step)` words it)."""
    device, scaler = context.device, run.scaler
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    loss_sum = torch.zeros((), device=device)
    for micro in range(tc.grad_accum):
        distributed.gradient_sync(run.wrapped, micro == tc.grad_accum - 1)
        inputs, targets = (t.to(device, non_blocking=True) for t in run.sampler.next())
        with autocast(device, tc.dtype):
            objective = training_loss(forward, inputs, targets, tc, train_mode, capacity, run.teacher, run.step + 1)
            total, loss = objective.total, objective.lm
            if make_nan:  # the test hook NAN_AT_STEP_ENV
                total, loss = total * float("nan"), loss * float("nan")
        scaler.scale(total / tc.grad_accum).backward()
        loss_sum += loss.detach()
    train_loss = distributed.mean_across_ranks(loss_sum / tc.grad_accum, context).item()
    if not math.isfinite(train_loss):
        raise TrainingDiverged(diverged(f"the loss became {train_loss}", run.step + 1))
    scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), tc.grad_clip or float("inf"))
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm) and not scaler.is_enabled():  # float16's scaler skips such steps itself
        raise TrainingDiverged(diverged(f"the gradient norm became {grad_norm}", run.step + 1))
    scaler.step(run.optimizer)
    scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return train_loss, grad_norm, objective


def expert_dropped(objective: Objective) -> float:
    """The share of real-expert choices the MoE blocks' training capacity dropped in this step, mean over the MoE
    blocks (one device sync)."""
    return torch.stack([stats.dropped for stats in objective.aux.experts.values()]).mean().item()


def _objective_metrics(objective: Objective, capacity: float | None, detailed: bool) -> dict[str, Any]:
    """metrics.jsonl's keys of one step's objective: each auxiliary loss; with routed blocks the capacity in force
    (--capacity-warmup); every --log-every steps (`detailed`) the routers' agreement and the per-block statistics
    (one device sync each)."""
    record: dict[str, Any] = {term.name: term.value.item() for term in objective.terms}
    records = objective.aux.records
    if records and capacity is not None:
        record["capacity"] = capacity
    if detailed:
        if records:
            record["routing"] = routing_agreement(records)
        for name, read in objective.readers.items():
            record[name] = read()
    return record
