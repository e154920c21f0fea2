"""Model families (`--arch`): which decoder class a config builds and what the family offers the commands.

Torch-free, so that modcli.config can validate `--arch` without importing a model: each family names its class as
"module:Class", imported only when a model is built (`model_class`). Commands ask the family's record (may it
carry MoD routers or experts, does it decode with exits, what `modcli export` makes of it) instead of comparing
names. A new family is one module and one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One model family."""

    name: str
    model: str
    """The decoder class, "module:Class"; it takes a ModelConfig and has MoDDecoder's interface."""
    description: str
    """The family in a few words (--help, the README)."""
    options: tuple[str, ...] = ()
    """ModelConfig fields that belong to this family alone; other families refuse values other than their default."""
    mod_routing: bool = True
    """MoD routers (--router, --capacity, --route-every, ...) may route its blocks."""
    experts: bool = True
    """Its blocks may have a mixture-of-experts MLP (--experts)."""
    exit_decoding: bool = False
    """`modcli generate --exit-threshold / --speculative` (decoding that leaves the stack early) applies."""
    exportable: bool = True
    """`modcli export` can lower it (else it refuses with `export_note` as the reason)."""
    router_fields: tuple[str, ...] = ()
    """MoD routing fields (router_weight, predictor_hidden, ...) the family's own routers read, though it has no MoD
    routed blocks."""
    export_note: str | None = None
    """What `modcli export` leaves out of the bundle for this family (logged and written to the manifest)."""


ARCHITECTURES: dict[str, Architecture] = {
    "mod": Architecture(
        "mod", "modcli.models.decoder:MoDDecoder",
        "Mixture-of-Depths decoder (dense with --dense / --route-every 0; MoE and MoDE with --experts)"),
    "early-exit": Architecture(
        "early-exit", "modcli.models.early_exit:EarlyExitDecoder",
        "LayerSkip-style early exit: dense blocks, layer dropout rising with depth, an exit loss at every layer "
        "through the shared final norm and head; confidence exit and self-speculative decoding",
        options=("layer_dropout_max", "exit_loss_scale"), mod_routing=False, experts=False, exit_decoding=True,
        export_note="the bundle holds the full-depth forward and decode graphs; confidence exit and self-speculative "
                    "decoding are not exported (the exit depth is data-dependent)"),
    "recursion": Architecture(
        "recursion", "modcli.models.recursion:RecursionDecoder",
        "Mixture-of-Recursions: unique first and last blocks, a shared stack applied --recursions times, expert-choice "
        "routing keeping a shrinking share of the tokens per step, recursion-wise KV cache",
        options=("recursions", "recursion_capacities"), mod_routing=False, experts=False, exportable=False,
        router_fields=("router_weight", "predictor_hidden"),
        export_note="its decode step keeps one KV cache per recursion step, which a bundle's "
                    "one-cache-per-block layout does not describe"),
}


def architecture(name: str) -> Architecture:
    return ARCHITECTURES[name]


def model_class(name: str) -> type:
    """The decoder class of a family, imported on first use."""
    module, cls = ARCHITECTURES[name].model.split(":")
    return getattr(importlib.import_module(module), cls)
