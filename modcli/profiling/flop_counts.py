"""Counted FLOPs of what `modcli profile` times (`torch.utils.flop_counter.FlopCounterMode`), beside the analytic ones
of `modcli.models.flops`; each count runs its call once more, untimed."""

from __future__ import annotations

import torch

from modcli.config import TrainConfig
from modcli.hardware import TORCH_DTYPES, autocast
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.models.flops import counted_flops
from modcli.profiling.calls import decode_tokens_for
from modcli.training.objective import training_loss

FLOPS_NOTE = (
    "Analytic and counted FLOPs both count matmuls and attention (q k^T and scores v, the full T x T square even "
    "though a causal kernel may skip the masked half); neither counts element-wise work (RMSNorm, RoPE, softmax, "
    "SiLU, residual adds, sigmoid router weights), the embedding lookup, top-k/sort, gather/scatter or the "
    "optimizer step. Training FLOPs are forward + backward: a matmul's backward is 2 x its forward, attention's "
    "2.5 x (the scores are recomputed), and the predictor's stop-gradient input gets no gradient."
)


def counted_forward(model: MoDDecoder, tokens: torch.Tensor, device: torch.device, dtype: str) -> dict[str, int]:
    """FLOPs per op of one no-grad forward of all B sequences (the router's training mode, as `forward_call`)."""

    def forward() -> None:
        with torch.no_grad(), autocast(device, dtype):
            model(tokens)

    return counted_flops(forward)


def counted_training(model: MoDDecoder, tokens: torch.Tensor, device: torch.device, dtype: str) -> int:
    """FLOPs of the FLOP-bearing part of a training step (`train_call`) over all B sequences: forward with the
    auxiliary losses, backward. The gradients it leaves are dropped."""
    model.train()

    def forward_backward() -> None:
        with autocast(device, dtype):
            total = training_loss(model, tokens, tokens.roll(-1, dims=1), TrainConfig()).total
        total.backward()

    counted = sum(counted_flops(forward_backward).values())
    model.zero_grad(set_to_none=True)
    return counted


def counted_decode(model: MoDDecoder, tokens: torch.Tensor, decode_tokens: int, routing: str,
                   dtype: str) -> tuple[int, int]:
    """FLOPs of the causal prefill of all B sequences, and of all `decode_tokens` decode steps after it (as
    `decode_call`)."""
    device = tokens.device
    batch, seq_len = tokens.shape
    cache = DecoderCache.allocate(model.config, batch, seq_len + decode_tokens, device, TORCH_DTYPES[dtype])
    new_tokens = decode_tokens_for(model.config.vocab_size, batch, seq_len, decode_tokens, device)

    def decode_all() -> None:
        for step in range(decode_tokens):
            model.decode_step(new_tokens[step], cache, routing)

    with torch.no_grad(), autocast(device, dtype):
        prefill = sum(counted_flops(lambda: model(tokens, routing, cache=cache)).values())
        decode = sum(counted_flops(decode_all).values())
    return prefill, decode
