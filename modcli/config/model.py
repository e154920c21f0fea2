"""ModelConfig: the shape of a decoder (widths, depth, heads, RoPE, MLP) and its checks, the routing and expert
options every family shares, and the chosen family's and router kind's own options as typed members
(`family_options`, `router_options`: dataclasses their specs declare). The routing checks and the layout they give
(which blocks are routed, k, the dense twin) are in its base class RoutingLayout (modcli.config.routing).

config.json holds the fields flat, in this order, the variant options among them (`flat`, `ModelConfig.of`), and
the command line reads each field's docstring as its flag's help.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Any

from modcli.config.routing import RoutingLayout
from modcli.config.validation import declared_field_types, require
from modcli.config.variant_options import MEMBERS, flatten, split_flat, variant_field_types

MLP_ACTIVATIONS = ("silu", "gelu-tanh")
"""--mlp-activation: the gated MLP's activation (SwiGLU, GeGLU with the tanh-approximated GELU)."""

SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_size", "mlp_hidden", "qkv_bias",
                "qk_norm", "norm_eps", "rope_base", "rope_scaling", "tie_embeddings", "experts", "noop_experts",
                "expert_routing", "hash_table", "sandwich_norm", "mlp_activation", "scale_embeddings", "sliding_window",
                "sliding_layers", "local_rope_base")
"""ModelConfig fields a run started --init-from another must share with it (routing fields may differ)."""


@dataclass
class ModelConfig(RoutingLayout):
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
    qk_norm: bool = False
    """An RMSNorm over each query and each key head (its own weight of the head size, shared by the heads), after
    the projection and before RoPE (Qwen3)."""
    sandwich_norm: bool = False
    """An RMSNorm after each sublayer too, on its output before the residual add (Gemma 3's post_attention_layernorm
    and post_feedforward_layernorm); in a routed block it is part of the block's delta f(x)."""
    mlp_activation: str = "silu"
    """The gated MLP's activation: silu (SwiGLU) or gelu-tanh (GeGLU with the tanh-approximated GELU: Gemma 3)."""
    scale_embeddings: bool = False
    """The token embedding is multiplied by sqrt(d_model), rounded to the embedding's dtype (Gemma 3)."""
    sliding_window: int = 0
    """Local attention on --sliding-layers: a query attends to keys at distance < this many positions (original
    positions, in routed blocks too); 0 = none. The KV cache of a local layer is still full-size."""
    sliding_layers: list[int] | None = None
    """Blocks with local (--sliding-window) attention; None = every block when --sliding-window is set."""
    local_rope_base: float = 0.0
    """RoPE base of the --sliding-layers (Gemma 3's rope_local_base_freq); 0 = --rope-base."""
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
    route_part: str = "block"
    """What a routed block skips for unselected tokens: block (attention and MLP), attention (only attention; the
    MLP runs on every token) or mlp (only the MLP; attention, and so the KV cache, covers every token)."""
    predictor_hidden: int = 32
    """Hidden width of the causal predictor MLP per routed block; 0 trains no predictor."""
    keep_first: int = 0
    """Routed blocks always process the tokens at positions 0..N-1 of a sequence (the attention sink a pretrained
    model leans on), in every routing mode; 0 = none."""
    keep_skipped_kv: bool = False
    """Routed attention (--route-part block or attention): a skipped token still computes and stores its keys and
    values (no query, output projection or MLP), so the processed tokens attend to every earlier token."""
    skip_update: str = "identity"
    """What a routed block gives the tokens it skips: identity (nothing: they ride the residual) or linear (a low-rank
    linear forecast of the skipped update, x + U(D(x)), rank --skip-rank; U starts at zero, so a conversion still
    starts at the original model; FlexiDepth's adapter, Informed Routing's forecaster)."""
    skip_rank: int = 16
    """--skip-update linear: the forecast's rank."""
    drop: str = ""
    """Static drops: sublayers removed for every token, e.g. attention:25-29,mlp:28 (block:N = both): they compute
    nothing, hold no weights and a dropped attention stores no keys and values. The --route-every pattern passes
    over blocks with a drop; --route-layers may not name one. "" = none."""
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
    family_options: Any = None
    """The family's own options (an instance of `family.options`, e.g. EarlyExitOptions; None here = its defaults,
    and None for a family without options). config.json and the flags spell them flat (modcli.config.variant_options)."""
    router_options: Any = None
    """The router kind's own options (an instance of its spec's `options`, e.g. ThresholdOptions), as family_options."""

    def __post_init__(self) -> None:
        require(self.vocab_size >= 2, f"--vocab-size must be >= 2, got {self.vocab_size}")
        require(self.d_model >= 1, f"--d-model must be positive, got {self.d_model}")
        require(self.n_layers >= 1, f"--n-layers must be positive, got {self.n_layers}")
        require(self.n_heads >= 1, f"--n-heads must be positive, got {self.n_heads}")
        require(
            self.head_size > 0 or self.d_model % self.n_heads == 0,
            f"--d-model ({self.d_model}) must be divisible by --n-heads ({self.n_heads})",
        )
        require(self.head_size >= 0, f"--head-size must be >= 0, got {self.head_size}")
        require(self.head_dim % 2 == 0, f"the head size must be even for RoPE, got {self.head_dim}")
        require(self.n_kv_heads >= 0 and self.n_heads % self.kv_heads == 0,
                f"--n-heads ({self.n_heads}) must be a multiple of the key/value heads ({self.n_kv_heads})")
        require(self.norm_eps is None or self.norm_eps > 0, f"--norm-eps must be positive, got {self.norm_eps}")
        require(self.rope_base > 1, f"--rope-base must be > 1, got {self.rope_base}")
        require(self.rope_scaling is None or self.rope_scaling.get("rope_type") == "llama3",
                f"rope_scaling must be of rope_type llama3, got {self.rope_scaling!r}")
        require(self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}")
        require(self.mlp_activation in MLP_ACTIVATIONS,
                f"--mlp-activation must be one of {', '.join(MLP_ACTIVATIONS)}, got {self.mlp_activation!r}")
        require(self.sliding_window >= 0, f"--sliding-window must be >= 0, got {self.sliding_window}")
        require(self.sliding_layers is None or all(0 <= layer < self.n_layers for layer in self.sliding_layers),
                f"--sliding-layers must name blocks 0..{self.n_layers - 1}, got {self.sliding_layers}")
        require(self.local_rope_base == 0 or self.local_rope_base > 1,
                f"--local-rope-base must be > 1 (or 0: --rope-base), got {self.local_rope_base}")
        self._check_arch()
        require(not self.gemma_options or self.family.gemma_traits,
                f"{', '.join(self.gemma_options)}: supported by --arch mod only so far, not {self.arch}")
        self._check_routing()
        self.family.validate(self)
        require(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}")
        require(self.mlp_hidden >= 0, f"--mlp-hidden must be >= 0, got {self.mlp_hidden}")

    @classmethod
    def of(cls, **values: Any) -> ModelConfig:
        """A ModelConfig from flat values, as config.json, --config files and the flags name them: each variant
        option (--threshold, --recursions, ...) goes to the member of the variant that owns it."""
        return cls(**split_flat(values, {"arch": cls.arch, "router": cls.router}))

    @classmethod
    def flat_field_types(cls) -> dict[str, Any]:
        """The type of every flat key: the fields but the two members, and every registered variant's options."""
        own = {name: hint for name, hint in declared_field_types(cls).items() if name not in MEMBERS}
        return {**own, **variant_field_types()}

    def flat(self) -> dict[str, Any]:
        """The fields by name with the variant options flat among them (config.json's model section)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in MEMBERS}
        values = {name: copy.deepcopy(value) for name, value in values.items()}
        return {**values, **flatten(self.family_options), **flatten(self.router_options)}

    def is_sliding(self, layer: int) -> bool:
        """Block `layer`'s attention is local (--sliding-window, --sliding-layers)."""
        return self.sliding_window > 0 and (self.sliding_layers is None or layer in self.sliding_layers)

    def rope_base_at(self, layer: int) -> float:
        """The RoPE base of block `layer`: --local-rope-base on a local layer where it is set, else --rope-base."""
        return self.local_rope_base if self.local_rope_base and self.is_sliding(layer) else self.rope_base

    @property
    def gemma_options(self) -> list[str]:
        """This model's Gemma 3 options, as flags. The mod family honours them everywhere (forward, cached and static
        decoding, the ONNX export and modcli-run, export --hf of a dense run); the other families, a routed or
        dropped export --hf and export --gguf refuse a model that sets any, naming them."""
        options = [("sandwich_norm", "--sandwich-norm"), ("scale_embeddings", "--scale-embeddings"),
                   ("sliding_window", "--sliding-window"), ("local_rope_base", "--local-rope-base")]
        named = [flag for name, flag in options if getattr(self, name)]
        return named + ([f"--mlp-activation {self.mlp_activation}"] if self.mlp_activation != "silu" else [])

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
