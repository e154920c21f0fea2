"""One adapter per Hugging Face model family: its config.json -> ModelConfig, and its tensor names -> modcli's.

Llama, Mistral, Qwen2 and Qwen3 share one decoder layout (pre-norm RMSNorm, RoPE, grouped-query attention, SwiGLU
MLP; Qwen3 adds an RMSNorm on each query and key head, `q_norm`/`k_norm`), so they share `LlamaAdapter`'s name map;
each family states what its config may ask for and what modcli refuses. The fused tensors: q, k and v projections
are concatenated into `attn.qkv` (rows [q; k; v], biases likewise), gate and up projections into `mlp.gate_up` (rows
[gate; up]). Gemma 3 has its own adapter (`Gemma3Adapter`: norms after each sublayer too, GeGLU, local layers).
Nothing subclasses or imports `transformers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from modcli.config import ModelConfig
from modcli.errors import UserError

DEFAULT_CONTEXT = 1024
"""modcli's training context (seq_len) of an imported model when --seq-len is not given (at most the model's)."""


COUNTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
"""config.json's required whole numbers (each >= 1; vocab_size >= 2)."""
OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
"""Whole numbers >= 1 that may be absent or null."""
OPTIONAL_NUMBERS = ("rope_theta", "rms_norm_eps")
"""Positive finite numbers that may be absent or null."""
OPTIONAL_FLAGS = ("tie_word_embeddings", "mlp_bias", "attention_bias", "use_sliding_window")
OPTIONAL_TABLES = ("rope_scaling", "rope_parameters")
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_config(hf: Any, origin: str = "config.json") -> None:
    """Every field the adapters read has its type and range, and the head counts divide as attention needs; else a
    UserError naming the field (`origin`: the file, for the message). A config is checked before anything is built:
    a string width or a null layer count would otherwise fail in torch, far from its cause."""
    if not isinstance(hf, dict):
        raise UserError(f"{origin}: must hold a JSON object (the model's settings), got a {type(hf).__name__}")

    def count(key: str, value: Any, least: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UserError(f"{origin}: {key} must be an integer >= {least}, got {value!r}")

    for key in COUNTS:
        if key not in hf:
            raise UserError(f"{origin}: {key} is missing")
        count(key, hf[key], 2 if key == "vocab_size" else 1)
    for key in OPTIONAL_COUNTS:
        if hf.get(key) is not None:
            count(key, hf[key])
    for key in OPTIONAL_NUMBERS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise UserError(f"{origin}: {key} must be a positive number, got {value!r}")
    for key in OPTIONAL_FLAGS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise UserError(f"{origin}: {key} must be true or false, got {hf[key]!r}")
    for key in OPTIONAL_TABLES:
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise UserError(f"{origin}: {key} must be a JSON object or null, got {hf[key]!r}")
    theta = (hf.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                              or not math.isfinite(theta) or theta <= 0):
        raise UserError(f"{origin}: rope_parameters' rope_theta must be a positive number, got {theta!r}")
    if not isinstance(hf.get("hidden_act", "silu"), str):
        raise UserError(f"{origin}: hidden_act must be a string, got {hf['hidden_act']!r}")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if hf.get("head_dim") is None and hf["hidden_size"] % heads:
        raise UserError(f"{origin}: num_attention_heads ({heads}) does not divide hidden_size ({hf['hidden_size']}) "
                        "and no head_dim gives the head size")
    if heads % kv_heads:
        raise UserError(f"{origin}: num_key_value_heads ({kv_heads}) does not divide num_attention_heads ({heads})")
    if (hf.get("head_dim") or hf["hidden_size"] // heads) % 2:
        raise UserError(f"{origin}: the head size ({hf.get('head_dim') or hf['hidden_size'] // heads}) must be even "
                        "for RoPE")
    if hf.get("max_position_embeddings") == 1:
        raise UserError(f"{origin}: max_position_embeddings must be >= 2, got 1")


class LlamaAdapter:
    architecture = "LlamaForCausalLM"
    has_qkv_bias = False
    has_qk_norm = False
    """RMSNorms on each query and key head before RoPE (Qwen3's q_norm, k_norm)."""

    def model_config(self, hf: dict[str, Any], seq_len: int | None, tensor_names: Collection[str],
                     origin: str = "config.json") -> ModelConfig:
        """A dense ModelConfig of the same shape, or a UserError naming what modcli cannot represent (or the field
        of `hf` that is malformed; `origin` names the file in that message)."""
        check_config(hf, origin)
        name = self.architecture
        if hf.get("hidden_act", "silu") != "silu":
            raise UserError(f"{name}: hidden_act {hf['hidden_act']!r} is not supported (modcli's MLP is SwiGLU)")
        if hf.get("mlp_bias"):
            raise UserError(f"{name}: mlp_bias is not supported")
        if "model.layers.0.self_attn.o_proj.bias" in tensor_names:
            raise UserError(f"{name}: a bias on the attention output projection (attention_bias) is not supported")
        max_positions = int(hf.get("max_position_embeddings") or DEFAULT_CONTEXT)
        context = min(max_positions, DEFAULT_CONTEXT) if seq_len is None else seq_len
        window = self.sliding_window(hf)
        if window is not None and window < context:
            raise UserError(f"{name}: sliding-window attention (window {window}) is not supported; import with "
                            f"--seq-len {window} or less, where the window never applies")
        d_model, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or d_model // heads)
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and (scaling.get("rope_type") or scaling.get("type")) != "llama3":
            raise UserError(f"{name}: rope_scaling {scaling.get('rope_type') or scaling.get('type')!r} is not "
                            "supported (only llama3)")
        if scaling is not None:
            for key in LLAMA3_SCALING_KEYS:
                value = scaling.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value <= 0:
                    raise UserError(f"{origin}: rope_scaling's {key} must be a positive number, got {value!r}")
            scaling = {"rope_type": "llama3", **{key: scaling[key] for key in LLAMA3_SCALING_KEYS}}
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_size=head_dim if head_dim * heads != d_model else 0, seq_len=context,
            mlp_hidden=int(hf["intermediate_size"]), route_every=0, dropout=0.0,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_base=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
            qkv_bias=self.has_qkv_bias or "model.layers.0.self_attn.q_proj.bias" in tensor_names,
            qk_norm=self.has_qk_norm, rope_scaling=scaling)

    def sliding_window(self, hf: dict[str, Any]) -> int | None:
        return None

    def expected_shapes(self, config: ModelConfig) -> dict[str, tuple[tuple[int, str], ...]]:
        """Each Hugging Face tensor `state_dict` reads -> its shape, every size with the config field it comes from."""
        d_model, vocab = (config.d_model, "hidden_size"), (config.vocab_size, "vocab_size")
        q_rows = (config.n_heads * config.head_dim, "num_attention_heads x head_dim")
        kv_rows = (config.kv_heads * config.head_dim, "num_key_value_heads x head_dim")
        hidden = (config.mlp_hidden, "intermediate_size")
        shapes = {"model.embed_tokens.weight": (vocab, d_model), "model.norm.weight": (d_model,)}
        if not config.tie_embeddings:
            shapes["lm_head.weight"] = (vocab, d_model)
        for i in range(config.n_layers):
            hf = f"model.layers.{i}"
            shapes |= {f"{hf}.input_layernorm.weight": (d_model,), f"{hf}.post_attention_layernorm.weight": (d_model,),
                       f"{hf}.self_attn.q_proj.weight": (q_rows, d_model),
                       f"{hf}.self_attn.k_proj.weight": (kv_rows, d_model),
                       f"{hf}.self_attn.v_proj.weight": (kv_rows, d_model),
                       f"{hf}.self_attn.o_proj.weight": (d_model, q_rows),
                       f"{hf}.mlp.gate_proj.weight": (hidden, d_model), f"{hf}.mlp.up_proj.weight": (hidden, d_model),
                       f"{hf}.mlp.down_proj.weight": (d_model, hidden)}
            if config.qkv_bias:
                shapes |= {f"{hf}.self_attn.q_proj.bias": (q_rows,), f"{hf}.self_attn.k_proj.bias": (kv_rows,),
                           f"{hf}.self_attn.v_proj.bias": (kv_rows,)}
            if config.qk_norm:
                head = (config.head_dim, "head_dim")
                shapes |= {f"{hf}.self_attn.q_norm.weight": (head,), f"{hf}.self_attn.k_norm.weight": (head,)}
        return shapes

    def check_shapes(self, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], origin: str,
                     field_names: Mapping[str, str] | None = None) -> None:
        """Every tensor present has the shape the config gives it, and no layer lies past num_hidden_layers; else a
        UserError naming the tensor and the config fields (`field_names`: how the source spells them). Missing
        tensors are named when read."""
        field_names = field_names or {}

        def spelled(label: str) -> str:
            return " x ".join(field_names.get(part, part) for part in label.split(" x "))

        layers = {int(name.split(".")[2]) for name in shapes
                  if name.startswith("model.layers.") and name.split(".")[2].isdigit()}
        if layers and max(layers) + 1 != config.n_layers:  # before listing the layers' shapes: n_layers may be huge
            raise UserError(f"{origin}: the weights hold layers 0..{max(layers)}, but "
                            f"{field_names.get('num_hidden_layers', 'num_hidden_layers')} is {config.n_layers}")
        for name, dims in self.expected_shapes(config).items():
            if name in shapes and tuple(shapes[name]) != tuple(size for size, _ in dims):
                raise UserError(f"{origin}: tensor {name} has shape {tuple(shapes[name])}, but the config makes it "
                                f"{tuple(size for size, _ in dims)} ({', '.join(spelled(label) for _, label in dims)})")

    def state_dict(self, config: ModelConfig, tensor: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """modcli's state dict from `tensor(hf_name)` (which names the missing tensor and its file)."""
        state = {"embed.weight": tensor("model.embed_tokens.weight"), "norm.weight": tensor("model.norm.weight")}
        if not config.tie_embeddings:
            state["head.weight"] = tensor("lm_head.weight")
        for i in range(config.n_layers):
            hf, ours = f"model.layers.{i}", f"blocks.{i}"
            attention = [f"{hf}.self_attn.{p}_proj" for p in "qkv"]
            state[f"{ours}.attn_norm.weight"] = tensor(f"{hf}.input_layernorm.weight")
            state[f"{ours}.attn.qkv.weight"] = torch.cat([tensor(f"{p}.weight") for p in attention])
            if config.qkv_bias:
                state[f"{ours}.attn.qkv.bias"] = torch.cat([tensor(f"{p}.bias") for p in attention])
            if config.qk_norm:
                state[f"{ours}.attn.q_norm.weight"] = tensor(f"{hf}.self_attn.q_norm.weight")
                state[f"{ours}.attn.k_norm.weight"] = tensor(f"{hf}.self_attn.k_norm.weight")
            state[f"{ours}.attn.proj.weight"] = tensor(f"{hf}.self_attn.o_proj.weight")
            state[f"{ours}.mlp_norm.weight"] = tensor(f"{hf}.post_attention_layernorm.weight")
            state[f"{ours}.mlp.gate_up.weight"] = torch.cat([tensor(f"{hf}.mlp.gate_proj.weight"),
                                                             tensor(f"{hf}.mlp.up_proj.weight")])
            state[f"{ours}.mlp.down.weight"] = tensor(f"{hf}.mlp.down_proj.weight")
        return state


class MistralAdapter(LlamaAdapter):
    architecture = "MistralForCausalLM"

    def sliding_window(self, hf: dict[str, Any]) -> int | None:
        return hf.get("sliding_window")


class Qwen2Adapter(LlamaAdapter):
    architecture = "Qwen2ForCausalLM"
    has_qkv_bias = True

    def sliding_window(self, hf: dict[str, Any]) -> int | None:
        return hf.get("sliding_window") if hf.get("use_sliding_window") else None


class Qwen3Adapter(Qwen2Adapter):
    """Qwen2's layout with q_norm and k_norm; q/k/v biases only where the weights hold them (attention_bias, which
    also puts a bias on the output projection that modcli refuses)."""

    architecture = "Qwen3ForCausalLM"
    has_qkv_bias = False
    has_qk_norm = True


class Gemma3Adapter(LlamaAdapter):
    """Gemma 3 (Gemma3ForCausalLM, Gemma3TextConfig): Qwen3's q/k norms plus a norm after each sublayer
    (--sandwich-norm), GeGLU with the tanh GELU, the embedding times sqrt(hidden_size), local sliding-window layers
    (`layer_types`) with their own RoPE base. Gemma's RMSNorms compute x * (1 + w) in float32: the adapter stores
    1 + w (in float32, before the run's dtype), so modcli's RMSNorm is unchanged. What modcli cannot represent
    (softcapping, a query scale other than head_dim ** -0.5, bidirectional attention, scaled RoPE) is refused."""

    architecture = "Gemma3ForCausalLM"
    has_qk_norm = True
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def model_config(self, hf: dict[str, Any], seq_len: int | None, tensor_names: Collection[str],
                     origin: str = "config.json") -> ModelConfig:
        check_config(hf, origin)
        name = self.architecture

        def refuse(what: str) -> UserError:
            return UserError(f"{name}: {what} is not supported")

        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise refuse(f"hidden_activation {activation!r} (modcli's GeGLU uses gelu_pytorch_tanh)")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                raise refuse(f"{key} {hf[key]!r} (logit softcapping)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise refuse("attention_bias or mlp_bias")
        if hf.get("use_bidirectional_attention"):
            raise refuse("use_bidirectional_attention")
        d_model, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or 256)  # Gemma3TextConfig's default
        scalar = hf.get("query_pre_attn_scalar", 256)
        if scalar != head_dim:
            raise refuse(f"query_pre_attn_scalar {scalar!r} other than head_dim ({head_dim}) (modcli scales queries "
                         "by head_dim ** -0.5)")
        n_layers = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = int(hf.get("sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        if (not isinstance(layer_types, list) or len(layer_types) != n_layers
                or not set(layer_types) <= {"sliding_attention", "full_attention"}):
            raise UserError(f"{origin}: layer_types must list sliding_attention or full_attention for each of the "
                            f"{n_layers} layers, got {layer_types!r}")
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        window = hf.get("sliding_window") if sliding else None
        if sliding and window is None:
            raise UserError(f"{origin}: sliding_window is missing, but layer_types names sliding layers")
        rope = hf.get("rope_parameters") or {}
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        for kind, table in (("full_attention", {**full, **(hf.get("rope_scaling") or {})}), ("sliding_attention", local)):
            rope_type = table.get("rope_type") or table.get("type") or "default"
            if rope_type != "default":
                raise refuse(f"RoPE scaling {rope_type!r} on the {kind} layers")
        global_base = float(full.get("rope_theta") or hf.get("rope_theta") or 1_000_000.0)
        local_base = float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10_000.0)
        max_positions = int(hf.get("max_position_embeddings") or DEFAULT_CONTEXT)
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=n_layers, n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_size=head_dim if head_dim * heads != d_model else 0,
            seq_len=min(max_positions, DEFAULT_CONTEXT) if seq_len is None else seq_len,
            mlp_hidden=int(hf["intermediate_size"]), route_every=0, dropout=0.0,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)), rope_base=global_base,
            norm_eps=float(hf.get("rms_norm_eps") or 1e-6), qk_norm=True, sandwich_norm=True,
            mlp_activation="gelu-tanh", scale_embeddings=True, sliding_window=int(window or 0),
            sliding_layers=sliding if window else None,
            local_rope_base=local_base if window and local_base != global_base else 0.0)

    def expected_shapes(self, config: ModelConfig) -> dict[str, tuple[tuple[int, str], ...]]:
        shapes = super().expected_shapes(config)
        d_model = (config.d_model, "hidden_size")
        for i in range(config.n_layers):
            for norm in self.NORMS[2:]:
                shapes[f"model.layers.{i}.{norm}.weight"] = (d_model,)
        return shapes

    def state_dict(self, config: ModelConfig, tensor: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        def unit_offset(name: str) -> torch.Tensor:  # Gemma's x * (1 + w), folded in float32
            return tensor(name).float() + 1.0

        state = {"embed.weight": tensor("model.embed_tokens.weight"), "norm.weight": unit_offset("model.norm.weight")}
        if not config.tie_embeddings:
            state["head.weight"] = tensor("lm_head.weight")
        for i in range(config.n_layers):
            hf, ours = f"model.layers.{i}", f"blocks.{i}"
            state[f"{ours}.attn.qkv.weight"] = torch.cat([tensor(f"{hf}.self_attn.{p}_proj.weight") for p in "qkv"])
            state[f"{ours}.attn.q_norm.weight"] = unit_offset(f"{hf}.self_attn.q_norm.weight")
            state[f"{ours}.attn.k_norm.weight"] = unit_offset(f"{hf}.self_attn.k_norm.weight")
            state[f"{ours}.attn.proj.weight"] = tensor(f"{hf}.self_attn.o_proj.weight")
            for norm, own in zip(self.NORMS, ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm"), strict=True):
                state[f"{ours}.{own}.weight"] = unit_offset(f"{hf}.{norm}.weight")
            state[f"{ours}.mlp.gate_up.weight"] = torch.cat([tensor(f"{hf}.mlp.gate_proj.weight"),
                                                             tensor(f"{hf}.mlp.up_proj.weight")])
            state[f"{ours}.mlp.down.weight"] = tensor(f"{hf}.mlp.down_proj.weight")
        return state


ADAPTERS = {adapter.architecture: adapter
            for adapter in (LlamaAdapter(), MistralAdapter(), Qwen2Adapter(), Qwen3Adapter(), Gemma3Adapter())}
