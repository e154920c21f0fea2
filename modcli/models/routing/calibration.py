"""Calibration of a model's causal rules to its capacity (`modcli train --calibrate`, the default with --init-from).

A new router's logits sit near 0, so a rule like "router logit > 0" keeps about half the tokens whatever --capacity
says, and a threshold keeps whatever share happens to pass it. Calibration shifts each router's (and predictor's)
decision boundary (`Router.calibrate`: a bias shift by a quantile of its logits) so that, on the given tokens, each
routed block's causal rule keeps about `capacity` of them. Block by block in order, because a block's decisions
change what the next block sees; each causal mode in turn (the topk router's `router` pass shifts the router and the
predictor, its `predictor` pass then the predictor alone, on the inputs that mode gives).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _calibrating_hook(capacity: float, calibrated: list[bool]):
    """A forward pre-hook for a routed block: it runs the block once on its input (the hook stands aside for that
    call), calibrates the block's router on that pass's record, and lets the block's own forward run with the
    shifted router, so every later block sees the calibrated decisions of the blocks before it."""
    busy = False

    def hook(block, args, kwargs):
        nonlocal busy
        if busy:
            return None
        busy = True
        try:
            _, record = block(*args, **kwargs)
        finally:
            busy = False
        calibrated.append(record.router.calibrate(record, capacity))
        return None

    return hook


@torch.no_grad()
def processed_shares(model, tokens: Tensor) -> dict[str, dict[str, float]]:
    """Per causal mode, per routed block (`blockN`), the share of `tokens` (B, T) its causal rule processes."""
    shares = {}
    for mode in model.causal_modes():
        records = model(tokens, mode, return_aux=True)[1].records
        shares[mode] = {f"block{record.layer}": record.selection.counts.sum().item() / record.router_logits.numel()
                        for record in records}
    return shares


@torch.no_grad()
def calibrate_causal_rules(model, tokens: Tensor, capacity: float | None = None) -> dict[str, dict[str, float]] | None:
    """Shift every routed block's causal rule so it keeps about `capacity` (default the configured one) of `tokens`
    (B, T); dropout is off meanwhile. Returns the shares each rule processes afterwards (`processed_shares`), or
    None when the router kind has nothing to calibrate (random) or the model is not routed."""
    if model.config.dense or not model.causal_modes():
        return None
    capacity = model.config.capacity if capacity is None else capacity
    was_training = model.training
    model.eval()
    try:
        calibrated: list[bool] = []
        routed = [block for block in model.blocks if getattr(block, "router", None) is not None]
        for mode in model.causal_modes():
            hooks = [block.register_forward_pre_hook(_calibrating_hook(capacity, calibrated), with_kwargs=True)
                     for block in routed]
            try:
                model(tokens, mode, return_aux=True)
            finally:
                for handle in hooks:
                    handle.remove()
        return processed_shares(model, tokens) if any(calibrated) else None
    finally:
        model.train(was_training)
