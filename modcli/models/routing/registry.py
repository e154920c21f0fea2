"""The router registry: every router kind by name, without importing torch.

A router kind is one module under modcli/models/routing/ plus one line here. `ROUTERS` holds what configuration and the
command line need before any model exists (the names, the ModelConfig fields each kind owns, what the kind needs of
the model around it, a summary for `--help` and the README); `router_class(kind)` imports the implementation when a
model is built. `ROUTER_KINDS` adds the one `--router` value that selects no tokens: integrated MoDE, whose routed
blocks route inside the MoE MLP (no-op experts, modcli.models.moe).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RouterSpec:
    kind: str
    implementation: str | None
    """"module:Class" of the Router subclass; None for a kind that selects no tokens."""
    summary: str
    options: tuple[str, ...] = ()
    """ModelConfig fields that only this kind reads (given to another kind, they are refused)."""
    selects_tokens: bool = True
    """A MoD router: it picks the tokens its block processes (False: integrated MoDE's no-op experts)."""
    has_parameters: bool = True
    """It learns a scorer (so --router-hidden applies)."""
    reads_previous_attention: bool = False
    """It ranks tokens by the attention maps of the dense block before (A-MoD): that block must not be routed."""
    decodes_with_predictor: bool = False
    """Its causal rule is the predictor alone (--predictor-hidden must be > 0)."""
    uses_noop_experts: bool = False
    """Its routed blocks add --noop-experts no-op experts to their MoE MLP."""


ROUTERS: dict[str, RouterSpec] = {spec.kind: spec for spec in (
    RouterSpec("topk", "modcli.models.routing.topk:TopKRouter",
               "expert-choice top-k of the router logits (the paper); decodes by the router's sign or a predictor"),
    RouterSpec("random", "modcli.models.routing.random:RandomRouter",
               "k random tokens per sequence, no parameters (the paper's control); decodes with probability capacity",
               has_parameters=False),
    RouterSpec("threshold", "modcli.models.routing.threshold:ThresholdRouter",
               "threshold-p (MoDification): processed when sigmoid(logit) > p, the same rule in training and decoding",
               options=("threshold", "capacity_max")),
    RouterSpec("attention", "modcli.models.routing.attention:AttentionRouter",
               "A-MoD: top-k of the attention each token received in the dense block before; decodes with a predictor",
               options=("attention_score",), has_parameters=False, reads_previous_attention=True,
               decodes_with_predictor=True),
)}

INTEGRATED = RouterSpec("integrated", None, "integrated MoDE: no-op experts in the routed blocks' MoE (no token "
                        "selection; needs --experts and --noop-experts)", options=("noop_experts",),
                        selects_tokens=False, uses_noop_experts=True)
ROUTER_KINDS: dict[str, RouterSpec] = {**ROUTERS, INTEGRATED.kind: INTEGRATED}
"""Every --router value."""


def router_class(kind: str) -> type:
    """The Router subclass (modcli.models.routing.base.Router) of a token-selecting kind, imported on first use."""
    module, name = ROUTERS[kind].implementation.split(":")
    return getattr(importlib.import_module(module), name)
