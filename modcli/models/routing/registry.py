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

from modcli.errors import UserError

ATTENTION_SCORES = ("neutral", "seen-by")


@dataclass(frozen=True)
class ThresholdOptions:
    """--router threshold's own options (ModelConfig.router_options)."""

    threshold: float | None = None
    """threshold router: a token is processed when sigmoid(router logit) > threshold (default 0.5)."""
    capacity_max: float | None = None
    """threshold router: most tokens per sequence in the static-shape mode (export, compile); default 2 x capacity."""

    def __post_init__(self) -> None:
        if not (self.threshold is None or 0.0 <= self.threshold < 1.0):
            raise UserError(f"--threshold must be in [0, 1), got {self.threshold}")
        if not (self.capacity_max is None or 0.0 < self.capacity_max <= 1.0):
            raise UserError(f"--capacity-max must be in (0, 1], got {self.capacity_max}")


@dataclass(frozen=True)
class AttentionOptions:
    """--router attention's (A-MoD's) own options (ModelConfig.router_options)."""

    attention_score: str = "neutral"
    """--router attention (A-MoD): how the attention a token received is scored, neutral (each weight against the
    usual one at its query-key distance, standardised per position over the batch; modcli.models.decoder
    `received_attention`) or seen-by (the sum over the queries that see the token divided by their number; runs
    saved before this option load with it)."""

    def __post_init__(self) -> None:
        if self.attention_score not in ATTENTION_SCORES:
            raise UserError(f"--attention-score must be one of {', '.join(ATTENTION_SCORES)}, got "
                            f"{self.attention_score!r}")


@dataclass(frozen=True)
class RouterSpec:
    kind: str
    implementation: str | None
    """"module:Class" of the Router subclass; None for a kind that selects no tokens."""
    summary: str
    options: type | None = None
    """The kind's own options: a frozen dataclass, each field a flag (its docstring the help), its `__post_init__`
    checking them; ModelConfig holds an instance as `router_options` (None: the kind has none). Given to another
    kind they are refused (modcli.config.variant_options)."""
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
               options=ThresholdOptions),
    RouterSpec("attention", "modcli.models.routing.attention:AttentionRouter",
               "A-MoD: top-k of the attention each token received in the dense block before; decodes with a predictor",
               options=AttentionOptions, has_parameters=False, reads_previous_attention=True,
               decodes_with_predictor=True),
)}

INTEGRATED = RouterSpec("integrated", None, "integrated MoDE: no-op experts in the routed blocks' MoE (no token "
                        "selection; needs --experts and --noop-experts)",
                        selects_tokens=False, uses_noop_experts=True)
ROUTER_KINDS: dict[str, RouterSpec] = {**ROUTERS, INTEGRATED.kind: INTEGRATED}
"""Every --router value."""


def router_class(kind: str) -> type:
    """The Router subclass (modcli.models.routing.base.Router) of a token-selecting kind, imported on first use."""
    module, name = ROUTERS[kind].implementation.split(":")
    return getattr(importlib.import_module(module), name)
