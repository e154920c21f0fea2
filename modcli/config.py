"""Configuration dataclasses (one per concern), presets, and the merge of preset < TOML file < flags."""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import Any

from modcli.errors import UserError
from modcli.models.families import DEFAULT_FAMILY, FAMILIES, Family
from modcli.models.routing.registry import ROUTER_KINDS

ROUTER_WEIGHTS = ("sigmoid", "identity", "none", "unit")
ROUTE_PARTS = ("block", "attention", "mlp")
ROUTING_MODES = ("topk", "router", "predictor")
DEVICES = ("auto", "cpu", "cuda", "mps")
TRAINABLE = ("all", "routers", "routers+norms")
OBJECTIVES = ("lm", "block-match")
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_size", "mlp_hidden", "qkv_bias",
                "norm_eps", "rope_base", "rope_scaling", "tie_embeddings", "experts", "noop_experts", "expert_routing",
                "hash_table")
"""ModelConfig fields a run started --init-from another must share with it (routing fields may differ)."""
DTYPES = ("float32", "bfloat16", "float16")
MOD_ROUTING_FIELDS = ("capacity", "route_offset", "route_layers", "router", "router_weight", "router_hidden",
                      "threshold", "capacity_max", "route_part", "predictor_hidden", "keep_first")
"""ModelConfig fields of MoD routing (besides route_every), refused by families without MoD routers."""
EXPERT_FIELDS = ("experts", "expert_top_k", "expert_capacity_factor", "expert_weight", "noop_experts",
                 "expert_routing", "hash_table")
EXPERT_WEIGHTS = ("unit", "probability")
EXPERT_ROUTINGS = ("learned", "hash")
HASH_TABLES = ("random", "balanced")
ATTENTION_SCORES = ("neutral", "seen-by")
LEGACY_DEFAULTS: dict[str, dict[str, tuple[Any, Any]]] = {
    "model": {"expert_weight": ("probability", lambda model: model.get("experts", 0) > 0),
              "recursion_update": ("delta", lambda model: _family_owns(model, "recursion_update")),
              "attention_score": ("seen-by", lambda model: _reads_attention(model))},
    "train": {"expert_aux_sum": (False, lambda train: True),
              "expert_gate_lr_scale": (lambda train: train.get("router_lr_scale", TrainConfig.router_lr_scale),
                                       lambda train: True),
              "expert_capacity_warmup": (0, lambda train: True)},
}
"""Fields added after runs were saved whose new default changes what such a run computes: section -> field ->
(the old behaviour's value, or a function of the saved section giving it; which saved sections it applies to). A
config.json without the field (a run saved before it existed) reads it with that value (`RunConfig.read_saved`);
a new run, from flags, a preset or a TOML file, gets the field's default."""


EXPERT_RECIPE = {"expert_gate_lr_scale": 0.1, "expert_capacity_warmup": 100}
"""The MoE training defaults of a learned gate (docs/families.md): on `modcli train --preset tiny --dense --experts 4
--max-steps 60` Switch's settings (the gate at --lr, no warm-up) dropped 14-49% of the expert choices at every step
from step 10 on; this recipe drops none in the warm-up and at most 8% at a step after it (160 steps). A run saved
before the fields existed loads with the old values (LEGACY_DEFAULTS); later runs' config.json holds them."""


def _family_owns(model: dict[str, Any], option: str) -> bool:
    """The saved model section's family (--arch) has `option` among its own options."""
    family = FAMILIES.get(model.get("arch", DEFAULT_FAMILY))
    return family is not None and option in family.options


def _reads_attention(model: dict[str, Any]) -> bool:
    """The saved model section's router reads the attention maps of the block before (A-MoD)."""
    spec = ROUTER_KINDS.get(model.get("router", ModelConfig.router))
    return spec is not None and spec.reads_previous_attention


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


@dataclass
class ModelConfig:
    """Shape and routing of an MoD decoder; `route_every=0` is the dense twin."""

    vocab_size: int = 256
    """Vocabulary size (256: byte-level tokens)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block (d_model must be divisible by it unless the head size is set, as imported models do)."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention; n_heads must be a multiple); 0 = n_heads."""
    head_size: int = 0
    """Width of each attention head; 0 = d_model / n_heads."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    norm_eps: float | None = None
    """Epsilon of the RMSNorms; None = the dtype's machine epsilon (PyTorch's default)."""
    rope_scaling: dict[str, Any] | None = None
    """Llama-3 RoPE frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}; None = plain RoPE."""
    seq_len: int = 128
    """Training context length in tokens."""
    mlp_hidden: int = 0
    """Hidden width of the SwiGLU MLP; 0 picks 8/3 x d_model rounded up to a multiple of 32."""
    capacity: float = 0.125
    """Fraction of tokens a routed block processes: k = max(1, floor(capacity x T))."""
    route_every: int = 2
    """Every how many blocks one is routed (2 = every other block, the paper's choice; 0 = dense)."""
    route_offset: int = 1
    """Index of the first routed block (block i is routed when i % route_every == route_offset)."""
    route_layers: list[int] | None = None
    """Route exactly these blocks (e.g. [1, 3, 5]) instead of every route_every-th one."""
    router: str = "topk"
    """Router kind of the routed blocks (modcli.models.routing.registry): topk, random, threshold, attention (A-MoD) or
    integrated (MoDE: no-op experts in the MoE MLP)."""
    router_weight: str = "sigmoid"
    """How the router logit scales the block's delta: sigmoid, identity (the paper), none (gating off) or unit (value
    1 with the sigmoid's gradient: a conversion --init-from a dense model starts as that model; its default there)."""
    router_hidden: int = 0
    """Hidden width of an MLP router (0: one linear layer), for routers with parameters."""
    threshold: float | None = None
    """threshold router: a token is processed when sigmoid(router logit) > threshold (default 0.5)."""
    capacity_max: float | None = None
    """threshold router: most tokens per sequence in the static-shape mode (export, compile); default 2 x capacity."""
    route_part: str = "block"
    """What a routed block skips for unselected tokens: block (attention and MLP), attention (only attention; the
    MLP runs on every token) or mlp (only the MLP; attention, and so the KV cache, covers every token)."""
    predictor_hidden: int = 32
    """Hidden width of the causal predictor MLP per routed block; 0 trains no predictor."""
    keep_first: int = 0
    """Routed blocks always process the tokens at positions 0..N-1 of a sequence (the attention sink a pretrained
    model leans on), in every routing mode; 0 = none."""
    dropout: float = 0.0
    """Dropout on attention weights and on block deltas during training."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head."""
    rope_base: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    experts: int = 0
    """Experts of the mixture-of-experts MLP in every block (modcli.models.moe); 0 = the dense SwiGLU MLP."""
    expert_top_k: int = 1
    """Experts each token chooses (token choice; no-op experts included)."""
    expert_capacity_factor: float = 1.25
    """Training only: slots per expert over the whole batch = ceil(factor x batch x tokens x top-k / (experts +
    no-op experts)); choices beyond them ride the residual. Evaluation and decoding have no limit."""
    attention_score: str = "neutral"
    """--router attention (A-MoD): how the attention a token received is scored, neutral (each weight against the
    usual one at its query-key distance, standardised per position over the batch; modcli.models.decoder
    `received_attention`) or seen-by (the sum over the queries that see the token divided by their number; runs
    saved before this option load with it)."""
    expert_weight: str = "unit"
    """How a chosen expert's gate probability p scales its update: unit (value 1 with the gradient of log p,
    p / p.detach(): the update is not shrunk) or probability (p itself; runs saved before this option load with
    it)."""
    noop_experts: int = 0
    """--router integrated (integrated MoDE): no-op experts added to the MoE of the routed blocks; a token that
    chooses one skips the MLP."""
    expert_routing: str = "learned"
    """How a token's expert is chosen: learned (a gate, token choice) or hash (Hash Layers, Roller et al. 2021: a
    fixed random table token id -> expert, balanced over the vocabulary, saved with the weights; no gate, weight 1,
    no balancing loss, top-1). Real text is not balanced over the vocabulary (bytes: one of 4 experts gets 57%), so
    use --hash-table balanced with it (or raise --expert-capacity-factor: 2.5 drops almost nothing on the byte corpus
    with the random table)."""
    hash_table: str = "random"
    """--expert-routing hash: how `modcli train` builds the table. random: a fixed permutation of the vocabulary
    modulo E, the same for every run (each expert gets vocab / E ids); balanced: Hash Layers' balanced assignment
    over the training split, the most frequent ids first, each to the expert with the fewest training tokens so far
    (on the byte corpus with E = 4 the experts get 28/24/24/24% of the tokens, against 57% for one with random).
    The table is saved with the weights; --resume and --init-from keep the saved one."""
    arch: str = "mod"
    """Model family (modcli.models.families): mod (Mixture-of-Depths, dense with --dense), early-exit (LayerSkip: layer
    dropout, an exit loss at every block, exit decoding) or recursion (Mixture-of-Recursions)."""
    layer_dropout_max: float = 0.1
    """--arch early-exit: training-time probability of skipping the last block for a whole sequence; block l of L
    is skipped with probability layer_dropout_max x l / (L - 1), 0 for the first."""
    exit_loss_scale: float = 0.5
    """--arch early-exit: weight of the early-exit loss beside the final layer's loss (weight 1): the exits of
    blocks 0..L-2, through the shared final norm and head, weighted (l + 1) / sum(j + 1), rising with depth."""
    recursions: int = 3
    """--arch recursion: how many times the shared stack runs (Mixture-of-Recursions); n_layers, the unrolled depth,
    must be 2 + recursions x the shared blocks (the first and last blocks are unique)."""
    recursion_capacities: list[float] | None = None
    """--arch recursion: share of the tokens each recursion step keeps (non-increasing, in (0, 1]); None =
    (N - r) / N for step r of N (1, 0.67, 0.33 for N = 3)."""
    recursion_update: str = "published"
    """--arch recursion: how a recursion step writes its selected tokens back: published (the MoR authors' code:
    x + alpha x sigmoid(l) x stack(x), a scatter-add of the stack's output) or delta (x + sigmoid(l) x (stack(x) -
    x), the MoD block update with the stack as f; runs saved before this option load with it)."""
    recursion_alpha: float = 0.1
    """--arch recursion with --recursion-update published: alpha, the scale of the scatter-added stack output (the
    authors' 0.1)."""

    def __post_init__(self) -> None:
        require(self.vocab_size >= 2, f"--vocab-size must be >= 2, got {self.vocab_size}")
        require(self.d_model >= 1, f"--d-model must be positive, got {self.d_model}")
        require(self.n_layers >= 1, f"--n-layers must be positive, got {self.n_layers}")
        require(self.n_heads >= 1, f"--n-heads must be positive, got {self.n_heads}")
        require(
            self.head_size > 0 or self.d_model % self.n_heads == 0,
            f"--d-model ({self.d_model}) must be divisible by --n-heads ({self.n_heads})",
        )
        require(self.head_dim % 2 == 0, f"the head size must be even for RoPE, got {self.head_dim}")
        require(self.n_kv_heads >= 0 and self.n_heads % self.kv_heads == 0,
                f"--n-heads ({self.n_heads}) must be a multiple of the key/value heads ({self.n_kv_heads})")
        require(self.norm_eps is None or self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}")
        require(self.rope_scaling is None or self.rope_scaling.get("rope_type") == "llama3",
                f"rope_scaling must be of rope_type llama3, got {self.rope_scaling!r}")
        require(self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}")
        self._check_arch()
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
        require(self.route_part in ROUTE_PARTS,
                f"--route-part must be one of {', '.join(ROUTE_PARTS)}, got {self.route_part!r}")
        require(self.router_hidden >= 0, f"--router-hidden must be >= 0, got {self.router_hidden}")
        require(self.experts >= 0, f"--experts must be >= 0, got {self.experts}")
        require(self.noop_experts >= 0, f"--noop-experts must be >= 0, got {self.noop_experts}")
        require(self.expert_capacity_factor > 0,
                f"--expert-capacity-factor must be positive, got {self.expert_capacity_factor}")
        require(self.attention_score in ATTENTION_SCORES,
                f"--attention-score must be one of {', '.join(ATTENTION_SCORES)}, got {self.attention_score!r}")
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
        defaults = {f.name: f.default for f in fields(self)}
        for owner in ROUTER_KINDS.values():
            for option in owner.options:
                require(owner is router or getattr(self, option) == defaults[option],
                        f"--{option.replace('_', '-')} is an option of --router {owner.kind}, not of --router "
                        f"{self.router}")
        require(self.threshold is None or 0.0 <= self.threshold < 1.0,
                f"--threshold must be in [0, 1), got {self.threshold}")
        require(self.capacity_max is None or 0.0 < self.capacity_max <= 1.0,
                f"--capacity-max must be in (0, 1], got {self.capacity_max}")
        require(router.has_parameters or self.router_hidden == 0,
                f"--router-hidden: the {self.router} router has no parameters")
        if router.decodes_with_predictor and self.route_every:
            require(self.predictor_hidden > 0, f"--router {self.router} decodes with a predictor: --predictor-hidden "
                                               "must be > 0")
        if router.reads_previous_attention and self.route_every:
            require(all(layer >= 1 and not self.is_routed(layer - 1) for layer in self.routed_layers()),
                    f"--router {self.router} reads the attention maps of the block before each routed block, which "
                    "must be dense: route no block 0 and no two blocks in a row (e.g. --route-every 2 --route-offset "
                    "1)")
        require(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}")
        require(self.mlp_hidden >= 0, f"--mlp-hidden must be >= 0, got {self.mlp_hidden}")

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
        defaults = {f.name: f.default for f in fields(self)}
        for other in FAMILIES.values():
            for option in other.options:
                require(other is spec or option in spec.options or getattr(self, option) == defaults[option],
                        f"--{option.replace('_', '-')} is an option of --arch {other.name}, not of --arch {self.arch}")
        if not spec.mod_routing:
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
        spec.validate(self)

    @property
    def family(self) -> Family:
        """The model family's spec (--arch): its routing layout, options, losses, decoding and export rules."""
        return FAMILIES[self.arch]

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        return 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def dense(self) -> bool:
        """No block is MoD-routed (no token skips a block by a MoD router); the MLPs may still be MoE."""
        return not self.routed_layers()

    @property
    def kind(self) -> str:
        """What the model is, in words: dense, MoE, MoD, staged MoDE, integrated MoDE, early exit, MoR."""
        return self.family.describe(self)

    def in_route_set(self, layer: int) -> bool:
        """The layer is one that --route-every / --route-offset / --route-layers name."""
        if self.route_layers is not None:
            return layer in self.route_layers
        return self.route_every > 0 and layer % self.route_every == self.route_offset % self.route_every

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

    def attention_is_routed(self, layer: int) -> bool:
        """The layer's attention (and so its KV cache) covers only the tokens its router selects."""
        return self.is_routed(layer) and self.route_part != "mlp"

    def mlp_is_routed(self, layer: int) -> bool:
        return self.is_routed(layer) and self.route_part != "attention"

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

    def dense_twin(self) -> ModelConfig:
        """The same shape with routing switched off: no MoD router, no no-op experts; an MoE MLP stays an MoE MLP
        (`train --dense --experts 4` is MoE alone). Another family's twin is the plain MoD decoder without routing
        (early exit: the same blocks without layer dropout, exit loss or exit decoding)."""
        defaults = {f.name: f.default for f in fields(self)}
        router = self.router if ROUTER_KINDS[self.router].selects_tokens else defaults["router"]
        family = {option: defaults[option] for spec in FAMILIES.values() for option in spec.options}
        return dataclasses.replace(self, route_every=0, route_layers=None, router=router, noop_experts=0,
                                   arch=DEFAULT_FAMILY, **family)

    def dense_mlp_twin(self) -> ModelConfig:
        """The fully dense model of the same shape: no routing and the dense SwiGLU MLP instead of experts."""
        return dataclasses.replace(self.dense_twin(), experts=0, expert_top_k=1, expert_routing="learned")


@dataclass
class DataConfig:
    """Where training text comes from."""

    data: str | None = None
    """A text file, a folder of files, or a tokenised .bin; None = the built-in Python stdlib corpus."""
    glob: str = "**/*"
    """Pattern of the files to read when --data is a folder."""
    val_fraction: float = 0.02
    """Fraction held out for validation (by file for folders, the tail for a single file)."""
    tokenizer: str = "bytes"
    """bytes (token = byte), or a tokenizer.json, relative to the run folder (runs made by `modcli import`)."""

    def __post_init__(self) -> None:
        require(0.0 < self.val_fraction < 0.5, f"--val-fraction must be in (0, 0.5), got {self.val_fraction}")


@dataclass
class TrainConfig:
    """Optimisation, logging and checkpointing of `modcli train`."""

    batch_size: int = 16
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimiser step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr x min_lr_ratio."""
    warmup: int = 20
    """Linear warm-up steps."""
    max_steps: int = 300
    """Optimiser steps (also the length of the cosine schedule)."""
    flops_budget: float = 0.0
    """Stop once this many training FLOPs (forward + backward, `modcli.models.flops.training_flops`) are spent; 0 = no budget."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms, biases or embeddings)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    router_aux_weight: float = 0.1
    """Weight of the router's auxiliary loss: for topk the BCE that teaches the router's sign to match top-k (causal
    decoding), for threshold the capacity regulariser."""
    expert_aux_weight: float = 0.01
    """Weight of the MoE load-balancing loss (Switch Transformer) of each MoE block, the losses summed (Switch's
    0.01 per layer); with --experts."""
    expert_capacity_warmup: int | None = None
    """MoE: the first this many steps train with no expert capacity limit (no choice dropped while the gate learns
    to balance; each expert does the whole batch's slots, and the FLOP count says so); 0 = off. None = 100 with a
    learned gate (EXPERT_RECIPE: with --expert-gate-lr-scale 0.1, no step from step 10 on drops over 10%), 0 with
    hash routing (a fixed table learns nothing) or without experts; runs saved before this default load with 0."""
    expert_aux_sum: bool = True
    """Sum the MoE blocks' load-balancing losses (Switch); False averages them over the blocks, as runs saved before
    this option did (their config.json loads with False)."""
    router_lr_scale: float = 1.0
    """Learning rate of the router parameters (and predictor) relative to --lr."""
    expert_gate_lr_scale: float = 0.1
    """Learning rate of the MoE gates relative to --lr (a token's first choice flips with a small change of its gate,
    and a lower rate moves fewer tokens between experts: docs/families.md); runs saved before this option load with
    their --router-lr-scale, which the gates followed then."""
    capacity_warmup: int = 0
    """Steps over which the capacity anneals linearly from 1.0 to --capacity (k is fixed within a step); 0 = off."""
    eval_every: int = 100
    """Evaluate and save a checkpoint every this many steps."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    log_every: int = 10
    """Print a progress line every this many steps when stderr is not a terminal."""
    seed: int = 1337
    """Seed for weights, data order and dropout."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""
    dtype: str = "float32"
    """Autocast dtype: float32, bfloat16 or float16."""
    compile: bool = False
    """torch.compile the model."""
    out: str = "runs/latest"
    """Run folder: checkpoints, metrics.jsonl, TensorBoard events."""
    resume: bool = False
    """Continue from the newest complete checkpoint in --out."""
    init_from: str | None = None
    """Start from this run's (or checkpoint's) weights and tokenizer: converts a dense (e.g. imported) model to MoD
    with the routing flags given; routers are new. The shape flags must match it."""
    trainable: str = "all"
    """Which parameters train: all, routers (routers and predictors only; the rest frozen) or routers+norms."""
    calibrate: bool = False
    """Before the first step, shift each router's (and predictor's) decision boundary so that on the first training
    batch every routed block's causal rule keeps about --capacity of the tokens (a new router's logits sit near 0, so
    "logit > 0" keeps about half whatever --capacity says); the default with --init-from."""
    objective: str = "lm"
    """The training loss: lm (next-token cross-entropy, backward through the whole model) or block-match (each routed
    block's output matched to the dense block's on the dense model's input to it, relative squared error; one forward
    and a backward through the routers only: cheaper per step, for conversions that train the routers). The loss
    reported in training is then the block-match loss; validation stays the language-model loss."""
    keep: int = 3
    """Keep the newest N checkpoints."""
    parallel: str = "ddp"
    """Under torchrun: ddp (replicated) or fsdp (FSDP2 fully_shard per block)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "log_every", "keep"):
            value = getattr(self, name)
            require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
        require(self.lr > 0, f"--lr must be positive, got {self.lr}")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")
        require(self.flops_budget >= 0, f"--flops-budget must be >= 0, got {self.flops_budget}")
        require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        require(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        require(self.router_aux_weight >= 0, f"--router-aux-weight must be >= 0, got {self.router_aux_weight}")
        require(self.expert_aux_weight >= 0, f"--expert-aux-weight must be >= 0, got {self.expert_aux_weight}")
        require(self.expert_capacity_warmup is None or self.expert_capacity_warmup >= 0,
                f"--expert-capacity-warmup must be >= 0, got {self.expert_capacity_warmup}")
        require(self.router_lr_scale > 0, f"--router-lr-scale must be positive, got {self.router_lr_scale}")
        require(self.expert_gate_lr_scale > 0,
                f"--expert-gate-lr-scale must be positive, got {self.expert_gate_lr_scale}")
        require(self.capacity_warmup >= 0, f"--capacity-warmup must be >= 0, got {self.capacity_warmup}")
        require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        require(self.parallel in ("ddp", "fsdp"), f"--parallel must be ddp or fsdp, got {self.parallel!r}")
        require(self.trainable in TRAINABLE, f"--trainable must be one of {', '.join(TRAINABLE)}, got {self.trainable!r}")
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.objective in OBJECTIVES,
                f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")


@dataclass
class RunConfig:
    """Everything `modcli train` needs, as saved in a checkpoint's config.json."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        # Defaults that depend on the model, resolved here so that config.json holds the value the run used (a copy:
        # the TrainConfig given may serve another model too).
        if self.train.expert_capacity_warmup is None:
            learned = self.model.experts > 0 and self.model.expert_routing == "learned"
            self.train = dataclasses.replace(
                self.train, expert_capacity_warmup=EXPERT_RECIPE["expert_capacity_warmup"] if learned else 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read_saved(cls, raw: dict[str, Any]) -> RunConfig:
        """A run config as a checkpoint's config.json holds it: a field the file lacks (saved before the field
        existed) takes its LEGACY_DEFAULTS value where there is one, so the old run computes what it computed."""
        sections = dict(raw)
        for section, legacy in LEGACY_DEFAULTS.items():
            values = sections.get(section, {})
            if isinstance(values, dict):
                sections[section] = {**{name: old(values) if callable(old) else old
                                        for name, (old, applies) in legacy.items()
                                        if name not in values and applies(values)}, **values}
        return cls.from_dict(sections)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        return cls(
            model=_build(ModelConfig, raw.get("model", {})),
            data=_build(DataConfig, raw.get("data", {})),
            train=_build(TrainConfig, raw.get("train", {})),
        )


PRESETS: dict[str, dict[str, Any]] = {
    # About a minute on 2 CPU cores with a clearly falling loss.
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, seq_len=128, batch_size=16, max_steps=300, lr=3e-3,
                 warmup=20, eval_every=100),
    # A few minutes to tens of minutes on a CPU; a realistic shape for `modcli profile`.
    "small": dict(d_model=256, n_layers=8, n_heads=8, seq_len=256, batch_size=16, max_steps=500, lr=2e-3,
                  warmup=50, eval_every=100),
    # For a GPU.
    "base": dict(d_model=512, n_layers=12, n_heads=8, seq_len=1024, batch_size=32, max_steps=20000, lr=1e-3,
                 warmup=500, eval_every=1000),
}


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


def check_config_values(raw: Any, where: str | None = None) -> None:
    """Every value of a run config in dict form (RunConfig.to_dict, or a config.json) has its field's type, and
    every number is finite. `where` names the file in messages; without it, values are named as flags.

    The dataclasses' own checks (modcli.config) then judge ranges; this catches what they let through (a
    string where a number belongs, NaN or infinity).
    """
    prefix = f"{where}: " if where else ""
    if not isinstance(raw, dict):
        raise UserError(f"{prefix}expected an object with model, data and train sections")
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        if not isinstance(values, dict):
            raise UserError(f"{prefix}{section} must be an object, got {values!r}")
        check_field_types(cls, values, lambda name, section=section: f"{where}: {section}.{name}" if where
                          else f"--{name.replace('_', '-')}")


def check_field_types(cls: type, values: dict[str, Any], label: Callable[[str], str]) -> None:
    """Each value named like a field of the dataclass `cls` has that field's annotated type (a bool is no number, a
    number is finite, an int is no float); the first that does not is one UserError, "<label(name)> must be <type>,
    got <value>". Names that are not fields are left to the caller. The one type check of config files: run configs
    (`check_config_values`), `--config` TOML files (`load_toml`), sweep grids (modcli.sweep.grid)."""
    hints = field_types(cls)
    for name, value in values.items():
        if name in hints and not value_fits(value, hints[name]):
            raise UserError(f"{label(name)} must be {describe_type(hints[name])}, got {value!r}")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The dataclass's fields and their annotated types ({} when an annotation does not resolve here: the
    dataclass's own checks are then all there is)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        return {}
    return {f.name: hints[f.name] for f in fields(cls) if f.name in hints}


def value_fits(value: Any, hint: Any) -> bool:
    """`value` (as JSON or TOML gives it) has the type `hint` (bool, int, float, str, list[...], dict, None, unions)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(value_fits(value, arm) for arm in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and (not args or all(value_fits(v, args[0]) for v in value))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def describe_type(hint: Any) -> str:
    """The type `hint` in words: "an integer", "a finite number or null", "true or false"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(arm) for arm in args)
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    if hint in names:
        return names[hint]
    if origin is list:
        return f"a list of {describe_type(args[0])}s" if args else "a list"
    if origin is dict or hint is dict:
        return "an object"
    return getattr(hint, "__name__", str(hint))



def _build(cls: type, values: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UserError(f"unknown {cls.__name__} key(s): {', '.join(unknown)}")
    return cls(**values)


def _section_of(key: str) -> str:
    for section, cls in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
        if key in {f.name for f in fields(cls)}:
            return section
    raise UserError(f"unknown option {key!r} (flags and config keys use the same names)")


FLAG_ONLY_KEYS: dict[str, Any] = {"dense": bool, "preset": str}
"""Keys of a --config file that set no config field themselves: --dense (routing off) and --preset (the values the
file and the flags start from); a sweep grid's tables take dense."""
LIST_FLAGS = ("route_layers", "recursion_capacities")
"""List fields that a flag (and so a config file) may also spell as comma-separated text, "1,3,5"."""


@functools.cache
def flag_types() -> dict[str, Any]:
    """Every key a --config file or a sweep grid's table may hold, and its type: the fields of the model, data and
    train configs, and FLAG_ONLY_KEYS."""
    hints = {name: hint for cls in SECTIONS.values() for name, hint in field_types(cls).items()}
    for name in LIST_FLAGS:
        hints[name] = typing.Union[hints[name], str]  # noqa: UP007 (a runtime union of a generic alias)
    return {**hints, **FLAG_ONLY_KEYS}


def check_flag_types(values: dict[str, Any], label: Callable[[str], str], alternatives: bool = False) -> None:
    """Each value of a flag-named key (`flag_types`) has its type; with `alternatives` (a sweep's [[variant]]), a
    list of values of that type lists alternatives. Keys that are no flag are left to the caller."""
    hints = flag_types()
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None or value_fits(value, hint):
            continue
        if alternatives and isinstance(value, list) and value and all(value_fits(v, hint) for v in value):
            continue
        listed = " (or a list of alternatives)" if alternatives else ""
        raise UserError(f"{label(name)} must be {describe_type(hint)}{listed}, got {value!r}")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config: flat keys named like the flags (dashes or underscores), or [model]/[data]/[train] tables
    of them, and `preset`. Every key must be a flag's, with that flag's type: one UserError naming the file and key."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config: no such file: {p}")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--config: {p} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise UserError(f"--config {p}: unknown table [{key}]; the tables are [model], [data] and [train] "
                                "(or put the keys at the top)")
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    unknown = sorted(set(flat) - set(flag_types()))
    if unknown:
        raise UserError(f"--config {p}: unknown option {unknown[0]!r} (flags and config keys use the same names)")
    check_flag_types(flat, lambda name: f"--config {p}: {name}")
    if "preset" in flat and flat["preset"] not in PRESETS:
        raise UserError(f"--config {p}: preset must be one of {', '.join(PRESETS)}, got {flat['preset']!r}")
    return flat


def resolve_run_config(
    preset: str | None = "tiny", config_file: str | None = None, overrides: dict[str, Any] | None = None,
    default_preset: str | None = None,
) -> RunConfig:
    """Merge preset < TOML file < flags (flags win) into a validated RunConfig. `preset` is the command line's
    --preset (None: not given); without it the file's `preset` key chooses, then `default_preset` (None: no preset,
    the dataclasses' defaults)."""
    from_file = load_toml(config_file) if config_file else {}
    file_preset = from_file.pop("preset", None)
    if preset is None:
        preset = file_preset if file_preset is not None else default_preset
    merged: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise UserError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
        merged.update(PRESETS[preset])
    merged.update(from_file)
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    dense = merged.pop("dense", False)
    if not isinstance(dense, bool):  # a file's types are checked in load_toml; this is the library's caller
        raise UserError(f"--dense must be true or false, got {dense!r}")
    if dense:
        merged["route_every"], merged["route_layers"] = 0, None
    if isinstance(merged.get("route_layers"), str):  # the flag: "1,3,5"
        try:
            merged["route_layers"] = [int(part) for part in merged["route_layers"].split(",") if part.strip()]
        except ValueError:
            raise UserError(f"--route-layers must be comma-separated block indices, got {merged['route_layers']!r}"
                            ) from None
    if isinstance(merged.get("recursion_capacities"), str):  # the flag: "1,0.5,0.25"
        try:
            merged["recursion_capacities"] = [float(part) for part in merged["recursion_capacities"].split(",")
                                              if part.strip()]
        except ValueError:
            raise UserError("--recursion-capacities must be comma-separated numbers, got "
                            f"{merged['recursion_capacities']!r}") from None
    merged.pop("preset", None)
    sections: dict[str, dict[str, Any]] = {"model": {}, "data": {}, "train": {}}
    for key, value in merged.items():
        sections[_section_of(key)][key] = value
    check_config_values(sections)  # a string where a number belongs (a TOML file), NaN, infinity: one line
    return RunConfig.from_dict(sections)
