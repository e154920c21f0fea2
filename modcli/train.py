"""`modcli train`: AdamW with warm-up and cosine decay, checkpoints, resume, metrics and a FLOP budget."""

from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from modcli.checkpoint import (
    complete_checkpoints,
    load_optimizer,
    load_weights,
    read_config,
    read_state,
    save_checkpoint,
)
from modcli.config import RunConfig, TrainConfig
from modcli.data import BatchSampler, Corpus, evaluation_batches, load_corpus
from modcli.errors import TrainingDiverged, UserError
from modcli.flops import training_flops
from modcli.losses import bits_per_byte, lm_loss, routing_agreement, routing_losses
from modcli.model import MoDDecoder
from modcli.reporting import MetricsLog, StepProgress, stderr_console
from modcli.runtime import autocast, resolve_device, seed_everything


@dataclass
class TrainResult:
    """What a training run achieved; `modcli train` prints it as the summary table."""

    run_dir: str
    checkpoint: str
    steps: int
    train_loss: float
    val_loss: float
    val_bits_per_byte: float
    tokens: int
    flops: float
    wall_time_s: float
    tokens_per_s: float
    dense: bool
    parameters: int


def learning_rate(step: int, total_steps: int, config: TrainConfig) -> float:
    """Linear warm-up to lr, then cosine decay to lr x min_lr_ratio at total_steps (steps count from 1)."""
    if config.warmup and step <= config.warmup:
        return config.lr * step / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, total_steps - config.warmup))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: MoDDecoder, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices of the blocks only (not norms, biases, embeddings or routers' biases)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.ndim == 2 and "embed" not in name else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def total_steps(config: RunConfig) -> int:
    """--max-steps, or with --flops-budget the steps that budget pays for (the budget wins)."""
    if config.train.flops_budget:
        return max(1, math.ceil(config.train.flops_budget / step_flops(config)))
    return config.train.max_steps


def step_flops(config: RunConfig) -> int:
    return training_flops(config.model, config.model.seq_len) * config.train.batch_size * config.train.grad_accum


@torch.no_grad()
def validation_loss(model: MoDDecoder, corpus: Corpus, config: RunConfig, device: torch.device,
                    routing: str = "topk") -> float:
    model.eval()
    losses = []
    for inputs, targets in evaluation_batches(corpus.val, config.model.seq_len, config.train.batch_size,
                                              config.train.eval_batches):
        with autocast(device, config.train.dtype):
            logits = model(inputs.to(device), routing)
        losses.append(lm_loss(logits, targets.to(device)).item())
    model.train()
    return sum(losses) / len(losses)


def _check_resumable(saved: RunConfig, config: RunConfig, checkpoint: Path) -> None:
    for section in ("model", "data"):
        old, new = getattr(saved, section), getattr(config, section)
        for f in fields(old):
            if getattr(old, f.name) != getattr(new, f.name):
                raise UserError(
                    f"--resume: --{f.name.replace('_', '-')} is {getattr(new, f.name)!r} but {checkpoint} was "
                    f"trained with {getattr(old, f.name)!r}"
                )


def _rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def _load_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]])


def train(config: RunConfig, quiet: bool = False) -> TrainResult:
    """Train an MoD decoder (or its dense twin) as `config` says; returns the summary of the run."""
    tc, mc = config.train, config.model
    device = resolve_device(tc.device)
    run_dir = Path(tc.out)
    existing = complete_checkpoints(run_dir)
    if tc.resume and not existing:
        raise UserError(f"--resume: no complete checkpoint in {run_dir}")
    if not tc.resume and existing:
        raise UserError(f"--out {run_dir} already holds checkpoints; pass --resume to continue or pick another --out")
    if tc.dtype == "float16" and device.type == "cpu":
        raise UserError("--dtype float16 is not supported for training on the CPU; use bfloat16 or float32")

    corpus = load_corpus(config.data, mc.seq_len)
    seed_everything(tc.seed)
    model = MoDDecoder(mc).to(device)
    optimizer = make_optimizer(model, tc)
    sampler = BatchSampler(corpus.train, mc.seq_len, tc.batch_size, tc.seed)
    scaler = torch.amp.GradScaler(device.type, enabled=tc.dtype == "float16")

    step, tokens, flops_spent, elapsed_before = 0, 0, 0.0, 0.0
    last_checkpoint = None
    if tc.resume:
        last_checkpoint = existing[-1]
        _check_resumable(read_config(last_checkpoint), config, last_checkpoint)
        load_weights(model, last_checkpoint)
        load_optimizer(optimizer, last_checkpoint)
        state = read_state(last_checkpoint)
        step, tokens, flops_spent = state["step"], state["tokens"], state["flops"]
        elapsed_before = state["elapsed_s"]
        sampler.load_state(state["sampler"])
        _load_rng_state(state["rng"])

    steps = total_steps(config)
    per_step_flops = step_flops(config)
    forward = torch.compile(model) if tc.compile else model
    metrics = MetricsLog(run_dir, resume_step=step if tc.resume else None)
    if not quiet:
        kind = "dense" if mc.dense else f"MoD capacity {mc.capacity} on blocks {mc.routed_layers()}"
        stderr_console.print(
            f"training {model.num_parameters():,} parameters ({kind}) on {corpus.description}, device {device}, "
            f"{steps} steps of {tc.batch_size * tc.grad_accum} x {mc.seq_len} tokens")
    progress = StepProgress(steps, step, tc.log_every, quiet)

    def checkpoint_state() -> dict:
        return {"step": step, "tokens": tokens, "flops": flops_spent, "elapsed_s": elapsed_before + elapsed(),
                "sampler": sampler.state(), "rng": _rng_state()}

    session_start = time.perf_counter()
    session_tokens = 0
    train_time = 0.0

    def elapsed() -> float:
        return time.perf_counter() - session_start

    train_loss = val_loss = float("nan")
    model.train()
    try:
        while step < steps:
            step_start = time.perf_counter()
            lr = learning_rate(step + 1, steps, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for _ in range(tc.grad_accum):
                inputs, targets = (t.to(device, non_blocking=True) for t in sampler.next())
                with autocast(device, tc.dtype):
                    logits, records = forward(inputs, "topk", return_records=True)
                    loss = lm_loss(logits, targets)
                    router_bce, predictor_bce = routing_losses(records)
                    total = loss + tc.router_aux_weight * router_bce.to(device) + predictor_bce.to(device)
                scaler.scale(total / tc.grad_accum).backward()
                loss_sum += loss.detach()
            train_loss = (loss_sum / tc.grad_accum).item()
            if not math.isfinite(train_loss):
                where = f"; the last good checkpoint is {last_checkpoint}" if last_checkpoint else ""
                raise TrainingDiverged(f"training diverged: the loss became {train_loss} at step {step + 1}{where}")
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_tokens = tc.batch_size * tc.grad_accum * mc.seq_len
            tokens += step_tokens
            session_tokens += step_tokens
            flops_spent += per_step_flops
            train_time += time.perf_counter() - step_start

            record = {"step": step, "loss": train_loss, "lr": lr, "grad_norm": float(grad_norm),
                      "tokens": tokens, "flops": flops_spent, "elapsed_s": elapsed_before + elapsed(),
                      "tokens_per_s": session_tokens / max(train_time, 1e-9)}
            if records:
                record["router_bce"] = router_bce.item()
                record["predictor_bce"] = predictor_bce.item()
            last_step = step == steps or (tc.flops_budget and flops_spent >= tc.flops_budget)
            if step % tc.log_every == 0 or last_step:
                if records:
                    record["routing"] = routing_agreement(records)
            if step % tc.eval_every == 0 or last_step:
                val_loss = validation_loss(model, corpus, config, device)
                record["val_loss"] = val_loss
                record["val_bits_per_byte"] = bits_per_byte(val_loss)
            metrics.write(record)
            progress.update(step, f"loss {train_loss:.3f} tok/s {record['tokens_per_s']:.0f}")
            if step % tc.eval_every == 0 or last_step:
                last_checkpoint = save_checkpoint(run_dir, step, model, optimizer, config, checkpoint_state(),
                                                  tc.keep)
            if last_step:
                break
    finally:
        progress.close()
        metrics.close()

    if last_checkpoint is None or not math.isfinite(val_loss):
        # Nothing left to train (resumed at the end): evaluate what is there.
        val_loss = validation_loss(model, corpus, config, device)
    return TrainResult(
        run_dir=str(run_dir), checkpoint=str(last_checkpoint), steps=step, train_loss=train_loss,
        val_loss=val_loss, val_bits_per_byte=bits_per_byte(val_loss), tokens=tokens, flops=flops_spent,
        wall_time_s=elapsed_before + elapsed(), tokens_per_s=session_tokens / max(train_time, 1e-9),
        dense=mc.dense, parameters=model.num_parameters(),
    )
