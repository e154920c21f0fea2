"""The router registry: every router kind by name, without importing torch.

A router kind is one module under modcli/models/routing/ plus one line here. `ROUTERS` holds what configuration and the
command line need before any model exists (the names, the ModelConfig fields each kind owns, a summary for
`--help` and the README); `router_class(kind)` imports the implementation when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modcli.models.routing.base import Router


@dataclass(frozen=True)
class RouterSpec:
    kind: str
    implementation: str
    """"module:Class" of the Router subclass."""
    summary: str
    options: tuple[str, ...] = ()
    """ModelConfig fields that only this kind reads (given to another kind, they are refused)."""


ROUTERS: dict[str, RouterSpec] = {spec.kind: spec for spec in (
    RouterSpec("topk", "modcli.models.routing.topk:TopKRouter",
               "expert-choice top-k of the router logits (the paper); decodes by the router's sign or a predictor"),
    RouterSpec("random", "modcli.models.routing.random:RandomRouter",
               "k random tokens per sequence, no parameters (the paper's control); decodes with probability capacity"),
    RouterSpec("threshold", "modcli.models.routing.threshold:ThresholdRouter",
               "threshold-p (MoDification): processed when sigmoid(logit) > p, the same rule in training and decoding",
               options=("threshold", "capacity_max")),
    RouterSpec("attention", "modcli.models.routing.attention:AttentionRouter",
               "A-MoD: top-k of the attention each token received in the dense block before; decodes with a predictor"),
)}


def router_class(kind: str) -> type[Router]:
    module, name = ROUTERS[kind].implementation.split(":")
    return getattr(importlib.import_module(module), name)
