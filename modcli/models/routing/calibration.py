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

from modcli.models.routing.base import RoutingRecord


class _Enough(Exception):
    """Raised by a forward hook once the routed block being calibrated has run: the blocks after it are not needed."""


def _record_of(model, tokens: Tensor, mode: str, index: int) -> RoutingRecord:
    """The `index`-th routing record of a causal forward of `model` in `mode`, running the model only as far as
    that routed block."""
    routed = [block for block in model.blocks if getattr(block, "router", None) is not None]
    found: list[RoutingRecord] = []

    def stop(module, args, output) -> None:
        found.append(output[1])
        raise _Enough

    handle = routed[index].register_forward_hook(stop)
    try:
        model(tokens, mode, return_aux=True)
    except _Enough:
        pass
    finally:
        handle.remove()
    return found[0]


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
        calibrated = False
        routed = sum(getattr(block, "router", None) is not None for block in model.blocks)
        for mode in model.causal_modes():
            for index in range(routed):
                record = _record_of(model, tokens, mode, index)
                calibrated |= record.router.calibrate(record, capacity)
        return processed_shares(model, tokens) if calibrated else None
    finally:
        model.train(was_training)
