"""One adapter per Hugging Face model family: its config.json -> ModelConfig, and its tensor names -> modcli's.

Llama, Mistral and Qwen2 share one decoder layout (pre-norm RMSNorm, RoPE, grouped-query attention, SwiGLU MLP), so
they share `LlamaAdapter`'s name map; each family states what its config may ask for and what modcli refuses. The
fused tensors: q, k and v projections are concatenated into `attn.qkv` (rows [q; k; v], biases likewise), gate
and up projections into `mlp.gate_up` (rows [gate; up]). Nothing subclasses or imports `transformers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from modcli.config import ModelConfig
from modcli.errors import UserError

DEFAULT_CONTEXT = 1024
"""modcli's training context (seq_len) of an imported model when --seq-len is not given (at most the model's)."""


class LlamaAdapter:
    architecture = "LlamaForCausalLM"
    has_qkv_bias = False

    def model_config(self, hf: dict[str, Any], seq_len: int | None, tensor_names: set[str]) -> ModelConfig:
        """A dense ModelConfig of the same shape, or a UserError naming what modcli cannot represent."""
        name = self.architecture
        if hf.get("hidden_act", "silu") != "silu":
            raise UserError(f"{name}: hidden_act {hf['hidden_act']!r} is not supported (modcli's MLP is SwiGLU)")
        if hf.get("mlp_bias"):
            raise UserError(f"{name}: mlp_bias is not supported")
        if "model.layers.0.self_attn.o_proj.bias" in tensor_names:
            raise UserError(f"{name}: a bias on the attention output projection (attention_bias) is not supported")
        max_positions = int(hf.get("max_position_embeddings", DEFAULT_CONTEXT))
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
            scaling = {"rope_type": "llama3", **{key: scaling[key] for key in (
                "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_size=head_dim if head_dim * heads != d_model else 0, seq_len=context,
            mlp_hidden=int(hf["intermediate_size"]), route_every=0, dropout=0.0,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_base=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=self.has_qkv_bias or "model.layers.0.self_attn.q_proj.bias" in tensor_names,
            rope_scaling=scaling)

    def sliding_window(self, hf: dict[str, Any]) -> int | None:
        return None

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


ADAPTERS = {adapter.architecture: adapter for adapter in (LlamaAdapter(), MistralAdapter(), Qwen2Adapter())}
