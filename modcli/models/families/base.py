"""`Family`: what one model family (`--arch`) declares. The defaults are the Mixture-of-Depths decoder's own rules.

Torch-free: configuration validates `--arch` and counts FLOPs without importing a model. Every method takes the
model's ModelConfig (modcli.config; not imported here, which imports this). A family overrides what differs and
leaves the rest; commands, training, FLOP counts, profiling and export ask these methods and flags instead of
comparing family names.
"""

from __future__ import annotations

import dataclasses
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
    decoding_options: type | None = None
    """The family's own options of `modcli generate`: a frozen dataclass, each field a flag (its docstring the help),
    its `__post_init__` checking them, and, if it needs to, a `check_generation(config)` method checking them against
    generate's own settings (the GenerateConfig: --temperature, --compile). GenerateConfig holds an instance as
    `family_decoding` (None: none given); given for a model of another family they are refused
    (modcli.config.variant_options.decoding_for)."""
    decoding: str | None = None
    """The decoding hook, "module:function", imported on first use (`decoding_hook`): function(model, options) -> the
    decoding `modcli generate` runs after the prefill instead of its full-depth steps
    (modcli.decode.generation.FamilyDecoding), or None where the options choose the full depth."""
    static_drops: bool = False
    """`--drop` may remove sublayers of its blocks (each block its own, decoded at one depth)."""
    gemma_traits: bool = False
    """Its decoder honours Gemma 3's options (sandwich norms, GeGLU, embedding scale, sliding-window attention and its
    RoPE base: `ModelConfig.gemma_options`)."""
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

    def decoding_flags(self) -> list[str]:
        """The `modcli generate` flags of its decoding options (none without them)."""
        options = self.decoding_options
        return [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(options)] if options else []

    def decoding_hook(self, model, options):
        """The family's own decoding of `model` with `options` (its decoding_options; None: none given): what its
        `decoding` hook builds, or None (the full-depth decoding of `modcli generate`)."""
        if options is None or self.decoding is None:
            return None
        module, function = self.decoding.split(":")
        return getattr(importlib.import_module(module), function)(model, options)

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

    # --- evaluation ----------------------------------------------------------------------------------------------

    def evaluation_losses(self, model, inputs, targets) -> dict:
        """`modcli eval`'s extra losses of the family on one validation batch, inputs and targets (B, T): name ->
        scalar tensor (nats/token), averaged over the batches into EvalResult.exit_losses. Called under the
        evaluation's autocast; none by default."""
        return {}
