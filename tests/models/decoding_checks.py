"""Equivalence checks shared by the tests of routing options: cached decoding against the causal full forward, and
the static decode step (modcli.decode.static) against eager cached decoding."""

from __future__ import annotations

import torch

from modcli.decode.static import StaticDecoder
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder

CPU = torch.device("cpu")
ATOL = 1e-5


def assert_cached_decoding_equals_forward(model: MoDDecoder, mode: str, batch: int = 3, length: int = 14,
                                          prefix: int = 4) -> DecoderCache:
    """A prefill of `prefix` tokens then one decode step per token = the full causal forward over all `length`
    (atol ATOL); returns the cache for the caller's own checks."""
    tokens = torch.randint(0, 256, (batch, length))
    full = model(tokens, mode)  # (B, T, V)
    cache = DecoderCache.allocate(model.config, batch, length, CPU)
    steps = [model(tokens[:, :prefix], mode, cache=cache)]
    steps += [model.decode_step(tokens[:, t], cache, mode)[:, None] for t in range(prefix, length)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    return cache


def assert_static_step_equals_eager(model: MoDDecoder, batch: int = 4, steps: int = 4,
                                    branch_free: bool = False) -> StaticDecoder:
    """The static decoder's prefill and steps = eager prefill and decode_step (atol ATOL); returns the decoder."""
    mode = model.causal_modes()[0]
    tokens = torch.randint(0, 256, (batch, 10))
    static = StaticDecoder(model, batch, 10 + steps + 6, mode, CPU, "float32", compile=False, branch_free=branch_free)
    cache = DecoderCache.allocate(model.config, batch, 10 + steps + 6, CPU)
    torch.testing.assert_close(static.prefill(tokens), model(tokens, mode, cache=cache), atol=ATOL, rtol=0)
    for t in range(steps):
        following = torch.randint(0, 256, (batch,), generator=torch.Generator().manual_seed(t))
        torch.testing.assert_close(static.step(following), model.decode_step(following, cache, mode), atol=ATOL,
                                   rtol=0)
    return static
