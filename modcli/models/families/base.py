"""`Family`: what one model family (`--arch`) declares. The defaults are the Mixture-of-Depths decoder's own rules.

Torch-free: configuration validates `--arch` and counts FLOPs without importing a model. Every method takes the
model's ModelConfig (modcli.config; not imported here, which imports this). A family overrides what differs and
leaves the rest; commands, training, FLOP counts, profiling and export ask these methods and flags instead of
comparing family names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from modcli.models.routing.registry import ROUTER_KINDS


@dataclass(frozen=True)
class Family:
    """One model family, registered by name in modcli.models.families."""

    name: str
    model: str
    """The decoder class, "module:Class"; it takes a ModelConfig and has MoDDecoder's interface."""
    description: str
    """The family in a few words (--help, the docs)."""
    options: type | None = None
    """The family's own options: a frozen dataclass, each field a flag (its docstring the help), its `__post_init__`
    checking them; ModelConfig holds an instance as `family_options` (None: the family has none). Flat in
    config.json and on the command line; given to another family they are refused (modcli.config.variant_options)."""
    aux_losses: tuple[str, ...] = ("routing", "experts")
    """The auxiliary losses its training objective adds (names in modcli.training.objective.AUX_LOSSES)."""
    mod_routing: bool = True
    """MoD routers (--router, --capacity, --route-every, ...) may route its blocks."""
    experts: bool = True
    """Its blocks may have a mixture-of-experts MLP (--experts)."""
    exit_decoding: bool = False
    """`modcli generate --exit-threshold / --speculative` (decoding that leaves the stack early) applies, and
    `modcli eval` reports the loss of the exit after every block (the decoder's `exit_layer_logits`)."""
    exportable: bool = True
    """`modcli export` can lower it (else it refuses with `export_note` as the reason)."""
    router_fields: tuple[str, ...] = ()
    """MoD routing fields (router_weight, predictor_hidden, ...) the family's own routers read, though it has no MoD
    routed blocks."""
    export_note: str | None = None
    """What `modcli export` leaves out of the bundle for this family (logged and written to the manifest), or why it
    cannot export at all."""

    def model_class(self) -> type:
        """The decoder class, imported on first use."""
        module, cls = self.model.split(":")
        return getattr(importlib.import_module(module), cls)

    # --- configuration ------------------------------------------------------------------------------------------

    def validate(self, config) -> None:
        """Check what the family needs of the whole model (its options against the shape: a UserError naming the
        flag); its options' own ranges are their dataclass's. Called by ModelConfig.__post_init__."""

    def describe(self, config) -> str:
        """What the model is, in words: dense, MoE, MoD, staged MoDE or integrated MoDE."""
        moe = f"E={config.experts}, top-{config.expert_top_k}" + (", hash" if config.expert_routing == "hash" else "")
        if config.noop_layers():
            return f"integrated MoDE ({moe}, {config.noop_experts} no-op)"
        if config.dense:
            return f"MoE ({moe})" if config.experts else "dense"
        mod = f"MoD {config.router}, c={config.capacity:g}"
        return f"staged MoDE ({mod}, {moe})" if config.experts else mod

    # --- routing layout (the unrolled depth: layer 0 .. n_layers - 1) ---------------------------------------------

    def is_routed(self, config, layer: int) -> bool:
        """A router picks which tokens the layer processes: the --route-every / --route-layers blocks, when the
        router kind selects tokens (integrated MoDE routes inside the MLP instead)."""
        return ROUTER_KINDS[config.router].selects_tokens and config.in_route_set(layer)

    def has_router_at(self, config, layer: int) -> bool:
        """A router runs at this layer (one per routed block for MoD)."""
        return self.is_routed(config, layer)

    def router_count(self, config) -> int:
        return sum(self.has_router_at(config, layer) for layer in range(config.n_layers))

    def block_tokens(self, config, layer: int, seq_len: int) -> tuple[int, int]:
        """(attention, MLP) tokens the layer processes in a forward pass of `seq_len` tokens at the configured
        capacity (--route-part decides which of the two a routed block restricts to its selected tokens)."""
        k = config.capacity_tokens(seq_len)
        return (k if config.attention_is_routed(layer) else seq_len, k if config.mlp_is_routed(layer) else seq_len)

    # --- training ------------------------------------------------------------------------------------------------

    def layer_dropout(self, config, layer: int) -> float:
        """Training-time probability that the layer is skipped for a whole sequence (0: never)."""
        return 0.0

    def extra_head_passes(self, config) -> int:
        """Extra passes through the final norm and LM head in a training forward (exit losses)."""
        return 0
