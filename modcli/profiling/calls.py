"""What `modcli profile` times on PyTorch (eager and compiled): forward, training step, causal prefill, decode step.

Each factory returns a timed call (`modcli_runtime.timing`): it runs once and returns its own durations in seconds,
synchronised with the device, so the same calls serve the timed runs (`modcli.profiling.measure`) and the memory
runs in a child process (`modcli.profiling.memory`). The onnxruntime calls are in `modcli.profiling.onnx`; the
inputs, the same for every backend, are here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from modcli_runtime.timing import TimedCall

from modcli.config import ModelConfig, TrainConfig
from modcli.decode.static import StaticDecoder
from modcli.hardware import TORCH_DTYPES, autocast
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.packed_linear import PackedLinears
from modcli.training.objective import training_loss
from modcli.training.schedule import make_optimizer


def input_tokens(model_config: ModelConfig, batch: int, seq_len: int, seed: int, device: torch.device) -> torch.Tensor:
    """The (B, T) tokens every measurement at T feeds (seed + T: each length draws its own)."""
    generator = torch.Generator().manual_seed(seed + seq_len)
    return torch.randint(0, model_config.vocab_size, (batch, seq_len), generator=generator).to(device)


def decode_tokens_for(vocab_size: int, batch: int, seq_len: int, decode_tokens: int,
                      device: torch.device) -> torch.Tensor:
    """The fixed tokens every decode measurement feeds after a prefill of T = seq_len tokens: (decode_tokens, B).
    Fixed rather than sampled, so sampling costs nothing and every call (and every backend) decodes the same."""
    generator = torch.Generator().manual_seed(seq_len)
    return torch.randint(0, vocab_size, (decode_tokens, batch), generator=generator).to(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that the clock reads what the call cost."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def forward_call(model, tokens: torch.Tensor, device: torch.device, dtype: str,
                 linears: PackedLinears | None = None) -> TimedCall:
    """One no-grad forward of `model` (a decoder or its compiled wrapper) in the router's training mode; inside
    `linears` (entered before the clock starts) where given."""

    def call() -> dict[str, float]:
        with linears or contextlib.nullcontext():
            synchronize(device)
            start = time.perf_counter()
            with torch.no_grad(), autocast(device, dtype):
                model(tokens)
            synchronize(device)
            return {"forward": time.perf_counter() - start}

    return call


def train_call(model: MoDDecoder, step_model, tokens: torch.Tensor, device: torch.device, dtype: str) -> TimedCall:
    """One optimiser step as `modcli train` takes it: aux losses, backward, clipping, AdamW (default settings).

    `model` owns the parameters; `step_model` is what is called (the model itself or its compiled wrapper).
    """
    train_config = TrainConfig()
    optimizer = make_optimizer(model, train_config)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
    targets = tokens.roll(-1, dims=1)  # (B, T): any targets cost the same
    model.train()

    def call() -> dict[str, float]:
        synchronize(device)
        start = time.perf_counter()
        with autocast(device, dtype):
            total = training_loss(step_model, tokens, targets, train_config).total  # the router's training mode
        scaler.scale(total).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return {"train_step": time.perf_counter() - start}

    return call


def _prefill_then_steps(prefill: Callable[[], Any], step: Callable[[torch.Tensor], Any], new_tokens: torch.Tensor,
                        device: torch.device, dtype: str,
                        linears: PackedLinears | None = None) -> dict[str, float]:
    """Time prefill() and then one step(token row) per row of new_tokens: seconds of the prefill and per step.
    `linears`: the packed kernel, entered before each clock starts (the prefill's products, then the steps' B rows)."""
    batch = new_tokens.shape[1]
    with linears.up_to() if linears else contextlib.nullcontext():
        synchronize(device)
        start = time.perf_counter()
        with autocast(device, dtype):
            prefill()
        synchronize(device)
        prefilled = time.perf_counter()
    with linears.up_to(batch) if linears else contextlib.nullcontext():
        stepping = time.perf_counter()
        with autocast(device, dtype):
            for tokens in new_tokens:
                step(tokens)
        synchronize(device)
        return {"prefill": prefilled - start, "decode": (time.perf_counter() - stepping) / len(new_tokens)}


def decode_call(model: MoDDecoder, tokens: torch.Tensor, decode_tokens: int, routing: str, device: torch.device,
                dtype: str, keep: dict | None = None, linears: PackedLinears | None = None) -> TimedCall:
    """Causal prefill of the T tokens into a fresh KV cache, then `decode_tokens` decode steps (eager; inside
    `linears`, entered before the clock starts, where given).

    The last call's cache is left in `keep["cache"]`.
    """
    batch, seq_len = tokens.shape
    new_tokens = decode_tokens_for(model.config.vocab_size, batch, seq_len, decode_tokens, device)
    kv_dtype = TORCH_DTYPES[dtype]

    @torch.no_grad()
    def call() -> dict[str, float]:
        cache = DecoderCache.allocate(model.config, batch, seq_len + decode_tokens, device, kv_dtype)
        seconds = _prefill_then_steps(lambda: model(tokens, routing, cache=cache),
                                      lambda step_tokens: model.decode_step(step_tokens, cache, routing),
                                      new_tokens, device, dtype, linears)
        if keep is not None:
            keep["cache"] = cache
        return seconds

    return call


def static_decode_call(static: StaticDecoder, tokens: torch.Tensor, decode_tokens: int, device: torch.device,
                       dtype: str) -> TimedCall:
    """`decode_call` through a compiled `modcli.decode.static.StaticDecoder`: its compiled causal prefill, then
    its compiled static-shape decode step, on the same tokens."""
    batch, seq_len = tokens.shape
    new_tokens = decode_tokens_for(static.model.config.vocab_size, batch, seq_len, decode_tokens, device)

    @torch.no_grad()
    def call() -> dict[str, float]:
        static.reset()
        return _prefill_then_steps(lambda: static.prefill(tokens), static.step, new_tokens, device, dtype)

    return call
