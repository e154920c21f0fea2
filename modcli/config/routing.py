"""The routing and family half of ModelConfig: the choices of the routing and expert flags, and `RoutingLayout`, the
base class of ModelConfig that validates the family's (--arch), the routers' and the experts' options and answers
which blocks are routed, how many tokens a routed block keeps and what the dense twin is.

The fields themselves are declared in ModelConfig (modcli.config.model); the methods here read them from `self`.
A family's and a router kind's own options are theirs (`Family.options`, `RouterSpec.options`), checked by their
dataclasses; here they are built into ModelConfig's members for the chosen variants.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import fields
from fractions import Fraction
from typing import Self

from modcli.config.drops import format_block_list, format_drops, parse_drops, part_items
from modcli.config.validation import require
from modcli.config.variant_options import build_options
from modcli.models.families import DEFAULT_FAMILY, FAMILIES, Family
from modcli.models.routing.registry import ROUTER_KINDS

ROUTER_WEIGHTS = ("sigmoid", "identity", "none", "unit")
ROUTE_PARTS = ("block", "attention", "mlp")
SKIP_UPDATES = ("identity", "linear")
ROUTING_MODES = ("topk", "router", "predictor")
MOD_ROUTING_FIELDS = ("capacity", "route_offset", "route_layers", "router", "router_weight", "router_hidden",
                      "route_part", "predictor_hidden", "keep_first", "keep_skipped_kv", "skip_update", "skip_rank")
"""ModelConfig fields of MoD routing (besides route_every), refused by families without MoD routers (the router
kinds' own options with them: `router_options` stays the default router's defaults)."""
EXPERT_FIELDS = ("experts", "expert_top_k", "expert_capacity_factor", "expert_weight", "noop_experts",
                 "expert_routing", "hash_table")
EXPERT_WEIGHTS = ("unit", "probability")
EXPERT_ROUTINGS = ("learned", "hash")
HASH_TABLES = ("random", "balanced")


@functools.lru_cache(maxsize=64)
def parse_route_parts(text: str, n_layers: int) -> tuple[tuple[int, str], ...]:
    """A per-block --route-part, "attention:1-9,mlp:20-25" -> ((1, "attention"), ..., (25, "mlp")) sorted by block
    (an item without a part continues the previous item's part); a plain part ("block") -> (). Mistakes are one
    line naming --route-part."""
    if ":" not in text:
        return ()
    parts: dict[int, str] = {}
    for part, blocks in part_items(text, ROUTE_PARTS, n_layers, "--route-part", "attention:1-9,mlp:20-25"):
        for layer in sorted(blocks):
            require(layer not in parts, f"--route-part: block {layer} is named twice in {text!r}")
            parts[layer] = part
    require(bool(parts), f"--route-part: no block named in {text!r}")
    return tuple(sorted(parts.items()))


def format_route_parts(parts: tuple[tuple[int, str], ...]) -> str:
    """The canonical per-block text: parts in ROUTE_PARTS order, each block list as ranges."""
    return ",".join(f"{part}:{format_block_list(tuple(layer for layer, p in parts if p == part))}"
                    for part in ROUTE_PARTS if any(p == part for _, p in parts))


@functools.lru_cache(maxsize=64)
def _parsed_drops(text: str, n_layers: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """--drop parsed once per text (the layout asks per block; the config holds only the text)."""
    return tuple(parse_drops(text, n_layers).items())


class RoutingLayout:
    """Routing, experts and family of a ModelConfig: their validation (`_check_arch`, `_check_routing`,
    `_check_expert_routing`, called from ModelConfig.__post_init__) and the layout they give. Holds no fields."""

    def _check_routing(self) -> None:
        """The MoD routing and expert flags: their ranges, their choices, and which router or family owns them."""
        require(0.0 < self.capacity <= 1.0, f"--capacity must be in (0, 1], got {self.capacity}")
        require(self.route_every >= 0, f"--route-every must be >= 0, got {self.route_every}")
        require(self.route_offset >= 0, f"--route-offset must be >= 0, got {self.route_offset}")
        if self.route_layers is not None:
            require(all(0 <= layer < self.n_layers for layer in self.route_layers)
                    and len(set(self.route_layers)) == len(self.route_layers),
                    f"--route-layers must name distinct blocks in 0..{self.n_layers - 1}, got {self.route_layers}")
            self.route_layers = sorted(self.route_layers)
        require(
            self.router_weight in ROUTER_WEIGHTS,
            f"--router-weight must be one of {', '.join(ROUTER_WEIGHTS)}, got {self.router_weight!r}",
        )
        require(self.predictor_hidden >= 0, f"--predictor-hidden must be >= 0, got {self.predictor_hidden}")
        require(self.keep_first >= 0, f"--keep-first must be >= 0, got {self.keep_first}")
        require(self.router in ROUTER_KINDS, f"--router must be one of {', '.join(ROUTER_KINDS)}, got {self.router!r}")
        per_block = parse_route_parts(self.route_part, self.n_layers)
        if per_block:  # --route-part attention:1-9,mlp:20-25: the named blocks are the routed ones
            self.route_part = format_route_parts(per_block)
            named = [layer for layer, _ in per_block]
            require(self.route_layers is None or list(self.route_layers) == named,
                    f"--route-part {self.route_part} names blocks {named} but --route-layers is {self.route_layers}: "
                    "give one of them (a per-block --route-part routes the blocks it names)")
            self.route_layers = named
        else:
            require(self.route_part in ROUTE_PARTS,
                    f"--route-part must be one of {', '.join(ROUTE_PARTS)} or PART:BLOCKS,... (e.g. "
                    f"attention:1-9,mlp:20-25), got {self.route_part!r}")
        require(not self.keep_skipped_kv or all(self.route_part_at(layer) != "mlp" for layer in self.routed_layers()),
                "--keep-skipped-kv: with --route-part mlp every token already attends and stores its keys and values; "
                "it needs --route-part block or attention")
        require(self.skip_update in SKIP_UPDATES,
                f"--skip-update must be one of {', '.join(SKIP_UPDATES)}, got {self.skip_update!r}")
        require(self.skip_rank >= 1, f"--skip-rank must be >= 1, got {self.skip_rank}")
        require(self.router_hidden >= 0, f"--router-hidden must be >= 0, got {self.router_hidden}")
        require(self.experts >= 0, f"--experts must be >= 0, got {self.experts}")
        require(self.noop_experts >= 0, f"--noop-experts must be >= 0, got {self.noop_experts}")
        require(self.expert_capacity_factor > 0,
                f"--expert-capacity-factor must be positive, got {self.expert_capacity_factor}")
        require(self.expert_weight in EXPERT_WEIGHTS,
                f"--expert-weight must be one of {', '.join(EXPERT_WEIGHTS)}, got {self.expert_weight!r}")
        router = ROUTER_KINDS[self.router]
        if router.uses_noop_experts:
            require(self.experts >= 1 and self.noop_experts >= 1,
                    f"--router {self.router} (integrated MoDE) needs --experts >= 1 and --noop-experts >= 1")
        self._check_expert_routing(router.uses_noop_experts)
        require(1 <= self.expert_top_k <= max(1, self.experts + self.noop_experts),
                f"--expert-top-k must be in 1..{max(1, self.experts + self.noop_experts)} (the experts), "
                f"got {self.expert_top_k}")
        require(router.uses_noop_experts or self.noop_experts == 0,
                f"--noop-experts is an option of --router integrated, not of --router {self.router}")
        self.router_options = build_options("router_options", self.router, self.router_options)
        require(router.has_parameters or self.router_hidden == 0,
                f"--router-hidden: the {self.router} router has no parameters")
        if router.decodes_with_predictor and self.route_every:
            require(self.predictor_hidden > 0, f"--router {self.router} decodes with a predictor: --predictor-hidden "
                                               "must be > 0")
        self._check_drops()
        if router.reads_previous_attention and self.route_every:
            require(all(layer >= 1 and not self.is_routed(layer - 1) for layer in self.routed_layers()),
                    f"--router {self.router} reads the attention maps of the block before each routed block, which "
                    "must be dense: route no block 0 and no two blocks in a row (e.g. --route-every 2 --route-offset "
                    "1)")

    def _check_drops(self) -> None:
        """--drop: parsed and kept canonical; only where the family can drop, never in a routed block, never the
        attention an attention-reading router (A-MoD) reads."""
        drops = parse_drops(self.drop, self.n_layers)
        self.drop = format_drops(drops)
        if not drops:
            return
        require(self.family.static_drops, f"--drop: --arch {self.arch} cannot drop sublayers (its blocks are shared "
                                          "or decode at several depths); --arch mod can")
        dropped = sorted({*drops.get("attention", ()), *drops.get("mlp", ())})
        routed = [layer for layer in dropped if self.in_route_set(layer)]
        require(not routed, f"--drop: block {routed[0] if routed else 0} is also in --route-layers: a block is "
                            "dropped or routed, not both")
        if ROUTER_KINDS[self.router].reads_previous_attention and not self.dense:
            readers = [layer for layer in self.routed_layers() if self.attention_dropped(layer - 1)]
            require(not readers, f"--drop: --router {self.router} reads the attention of block "
                                 f"{readers[0] - 1 if readers else 0}, which is dropped")

    def _check_expert_routing(self, integrated: bool) -> None:
        """--expert-routing and what hash routing (a fixed table, no gate) cannot do."""
        require(self.expert_routing in EXPERT_ROUTINGS,
                f"--expert-routing must be one of {', '.join(EXPERT_ROUTINGS)}, got {self.expert_routing!r}")
        require(self.hash_table in HASH_TABLES,
                f"--hash-table must be one of {', '.join(HASH_TABLES)}, got {self.hash_table!r}")
        if self.expert_routing != "hash":
            require(self.hash_table == "random", "--hash-table is an option of --expert-routing hash")
            return
        require(self.experts >= 1, "--expert-routing hash needs --experts >= 1")
        require(not integrated and self.noop_experts == 0,
                f"--expert-routing hash: integrated MoDE's gate chooses its no-op experts; use --router topk "
                f"(staged MoDE) or --expert-routing learned, got --router {self.router}")
        require(self.expert_top_k == 1, f"--expert-routing hash chooses one expert per token: --expert-top-k must "
                                        f"be 1, got {self.expert_top_k}")
        require(self.expert_weight == "unit", "--expert-weight probability: hash routing has no gate, its weight is "
                                              "1 (--expert-weight unit)")

    def _check_arch(self) -> None:
        """--arch and the options that belong to one family only; a family without MoD routers gets route_every 0
        (its default, 2, means "not given" there) and refuses the routing and expert flags it cannot honour."""
        require(self.arch in FAMILIES, f"--arch must be one of {', '.join(FAMILIES)}, got {self.arch!r}")
        spec = self.family
        self.family_options = build_options("family_options", self.arch, self.family_options)
        defaults = {f.name: f.default for f in fields(self)}
        if not spec.mod_routing:
            require(not self.router_options, f"--router {self.router}'s options are Mixture-of-Depths options: "
                                             f"--arch {self.arch} has no routed blocks")
            for name in ("route_every", *MOD_ROUTING_FIELDS):
                ok = (getattr(self, name) == defaults[name] or (name == "route_every" and self.route_every == 0)
                      or name in spec.router_fields)
                require(ok, f"--{name.replace('_', '-')} is a Mixture-of-Depths option: --arch {self.arch} has no "
                            "routed blocks")
            self.route_every = 0
        if not spec.experts:
            for name in EXPERT_FIELDS:
                require(getattr(self, name) == defaults[name],
                        f"--{name.replace('_', '-')}: --arch {self.arch} has dense MLPs (no experts)")

    def attention_dropped(self, layer: int) -> bool:
        """--drop: the block has no attention (no K/V projections, no KV cache)."""
        return layer in self._dropped("attention")

    def mlp_dropped(self, layer: int) -> bool:
        """--drop: the block has no MLP."""
        return layer in self._dropped("mlp")

    def _dropped(self, part: str) -> tuple[int, ...]:
        return dict(_parsed_drops(self.drop, self.n_layers)).get(part, ())

    def kept_part(self, layer: int) -> str | None:
        """What a block computes after --drop: block (attention and MLP), attention, mlp, or None (nothing: the
        block is the identity)."""
        attention, mlp = not self.attention_dropped(layer), not self.mlp_dropped(layer)
        return "block" if attention and mlp else "attention" if attention else "mlp" if mlp else None

    def kv_layers(self) -> list[int]:
        """The layers that hold a KV cache (every layer whose attention is not dropped)."""
        return [layer for layer in range(self.n_layers) if not self.attention_dropped(layer)]

    @property
    def family(self) -> Family:
        """The model family's spec (--arch): its routing layout, options, losses, decoding and export rules."""
        return FAMILIES[self.arch]

    @property
    def dense(self) -> bool:
        """No block is MoD-routed (no token skips a block by a MoD router); the MLPs may still be MoE."""
        return not self.routed_layers()

    @property
    def kind(self) -> str:
        """What the model is, in words: dense, MoE, MoD, staged MoDE, integrated MoDE, early exit, MoR."""
        drops = f", dropped {self.drop}" if self.drop else ""
        return self.family.describe(self) + drops

    def in_route_set(self, layer: int) -> bool:
        """The layer is one that --route-every / --route-offset / --route-layers name (the --route-every pattern
        leaves out blocks with a --drop)."""
        if self.route_layers is not None:
            return layer in self.route_layers
        return (self.route_every > 0 and layer % self.route_every == self.route_offset % self.route_every
                and self.kept_part(layer) == "block")  # the pattern passes over blocks --drop cut

    def is_routed(self, layer: int) -> bool:
        """The block has a router that picks which tokens it processes (the family's rule; `layer` counts the
        unrolled depth). Integrated MoDE has none: its routed blocks choose no-op experts in the MLP instead."""
        return self.family.is_routed(self, layer)

    def router_count(self) -> int:
        """Routers in the model (one per MoD-routed block, or the family's count)."""
        return self.family.router_count(self)

    def has_router_at(self, layer: int) -> bool:
        """A router runs at this (unrolled) layer."""
        return self.family.has_router_at(self, layer)

    def noop_layers(self) -> list[int]:
        """Blocks whose MoE MLP has no-op experts (integrated MoDE: the --route-every / --route-layers blocks)."""
        uses_noop = ROUTER_KINDS[self.router].uses_noop_experts
        return [i for i in range(self.n_layers) if uses_noop and self.in_route_set(i)]

    def noop_experts_of(self, layer: int) -> int:
        return self.noop_experts if layer in self.noop_layers() else 0

    def routed_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_routed(i)]

    def route_part_at(self, layer: int) -> str:
        """What the routed block `layer` skips for unselected tokens: block, attention or mlp (--route-part, the same
        for every block or per block)."""
        per_block = dict(parse_route_parts(self.route_part, self.n_layers))
        return per_block.get(layer, "block") if per_block else self.route_part

    def attention_is_routed(self, layer: int) -> bool:
        """The layer's attention (and so its KV cache) covers only the tokens its router selects."""
        return self.is_routed(layer) and self.route_part_at(layer) != "mlp"

    def kv_is_routed(self, layer: int) -> bool:
        """Only the tokens the layer's router selects store K/V (its KV cache holds the processed tokens only): its
        attention is routed and skipped tokens keep no keys and values (no --keep-skipped-kv)."""
        return self.attention_is_routed(layer) and not self.keep_skipped_kv

    def mlp_is_routed(self, layer: int) -> bool:
        return self.is_routed(layer) and self.route_part_at(layer) != "attention"

    def capacity_tokens(self, seq_len: int) -> int:
        """k for a sequence of `seq_len` tokens: max(1, floor(capacity x T)), in exact integer arithmetic.

        The capacity is read as a fraction num/den (e.g. 0.125 = 1/8) so that k = T * num // den has no
        floating-point surprises (0.29 x 100 is 28.999... in floats) and can be computed the same way
        inside an exported graph.
        """
        num, den = self.capacity_fraction()
        return max(1, (seq_len * num) // den)

    def capacity_fraction(self) -> tuple[int, int]:
        frac = Fraction(self.capacity).limit_denominator(1_000_000)
        return frac.numerator, frac.denominator

    def dense_twin(self) -> Self:
        """The same shape with routing switched off: no MoD router, no no-op experts; an MoE MLP stays an MoE MLP
        (`train --dense --experts 4` is MoE alone). Another family's twin is the plain MoD decoder without routing
        (early exit: the same blocks without layer dropout, exit loss or exit decoding). Static drops (--drop) are
        put back: the twin is the whole model."""
        defaults = {f.name: f.default for f in fields(self)}
        keeps_router = ROUTER_KINDS[self.router].selects_tokens
        router = self.router if keeps_router else defaults["router"]
        return dataclasses.replace(self, route_every=0, route_layers=None, router=router, noop_experts=0, drop="",
                                   arch=DEFAULT_FAMILY, family_options=None,
                                   router_options=self.router_options if keeps_router else None)

    def dense_mlp_twin(self) -> Self:
        """The fully dense model of the same shape: no routing and the dense SwiGLU MLP instead of experts."""
        return dataclasses.replace(self.dense_twin(), experts=0, expert_top_k=1, expert_routing="learned")
