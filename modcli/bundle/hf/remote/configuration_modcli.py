"""The configuration of a Mixture-of-Depths decoder exported by `modcli export --hf` (remote code: needs only
torch and transformers; modcli is not imported). Loaded through `config.json`'s `auto_map`."""

from __future__ import annotations

from transformers import PretrainedConfig


class ModcliConfig(PretrainedConfig):
    """Shape and causal routing of the exported decoder; field names follow transformers where it has one."""

    model_type = "modcli"

    def __init__(self, vocab_size: int = 256, hidden_size: int = 128, num_hidden_layers: int = 4,
                 num_attention_heads: int = 4, num_key_value_heads: int | None = None, head_dim: int | None = None,
                 intermediate_size: int = 352, rms_norm_eps: float | None = None, rope_base: float = 10000.0,
                 llama3_rope_scaling: dict | None = None, qkv_bias: bool = False, max_position_embeddings: int = 128,
                 tie_word_embeddings: bool = True, routed_layers: list[int] | None = None, route_part: str = "block",
                 route_decision: str = "score", route_cut: float | None = 0.0, route_score: bool = True,
                 router_weight: str = "sigmoid", router_hidden: int = 0, predictor_hidden: int = 0,
                 keep_first: int = 0, capacity: float = 1.0, experts: int = 0, expert_top_k: int = 1,
                 noop_layers: list[int] | None = None, noop_experts: int = 0,
                 expert_weight: str = "probability", expert_routing: str = "learned", use_cache: bool = True,
                 dropped_attention: list[int] | None = None, dropped_mlp: list[int] | None = None,
                 keep_skipped_kv: bool = False, qk_norm: bool = False, skip_rank: int = 0, route_parts: dict | None = None,
                 **kwargs) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps  # None: the dtype's machine epsilon (torch.nn.RMSNorm's default)
        self.rope_base = rope_base
        self.llama3_rope_scaling = llama3_rope_scaling
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm  # an RMSNorm over each query and key head before RoPE (Qwen3)
        self.max_position_embeddings = max_position_embeddings
        self.routed_layers = list(routed_layers or [])  # blocks whose router picks the tokens they process
        self.route_part = route_part  # block, attention or mlp: what a routed block skips for unpicked tokens
        self.route_decision = route_decision  # score (router logit > cut), predictor (logit > 0), position_hash
        self.route_cut = route_cut  # the decision's cut; None = every token passes (a threshold of 0)
        self.route_score = route_score  # routed blocks have a scoring network whose logit gives the update weight
        self.router_weight = router_weight  # sigmoid, identity, none or unit: the weight as a function of the logit
        self.router_hidden = router_hidden  # hidden width of an MLP scorer; 0 = one linear layer
        self.predictor_hidden = predictor_hidden  # hidden width of the causal predictor MLP; 0 = none
        self.keep_first = keep_first  # routed blocks always process positions 0..keep_first-1
        self.capacity = capacity  # the share of tokens the router was trained to pick
        self.experts = experts  # experts of the mixture-of-experts MLP in every block; 0 = dense SwiGLU
        self.expert_top_k = expert_top_k
        self.noop_layers = list(noop_layers or [])  # blocks whose MoE has no-op experts (integrated MoDE)
        self.noop_experts = noop_experts
        self.expert_weight = expert_weight  # "unit": a chosen expert's update is not scaled; "probability": by p
        self.expert_routing = expert_routing  # "learned": a gate chooses; "hash": the table hash_table[token id]
        self.use_cache = use_cache
        self.dropped_attention = list(dropped_attention or [])  # static drops: blocks without attention (no cache)
        self.dropped_mlp = list(dropped_mlp or [])  # blocks without an MLP
        self.keep_skipped_kv = keep_skipped_kv  # routed attention: skipped tokens still store their K/V
        self.route_parts = route_parts or {}  # {"layer": part}: a per-block --route-part (else route_part for all)
        self.skip_rank = skip_rank  # > 0: a routed block's skipped tokens get a low-rank forecast x + U(D(x))
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
