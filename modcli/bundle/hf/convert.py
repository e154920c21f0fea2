"""A modcli model -> a Hugging Face config.json and state dict: the plain Llama / Mistral / Qwen2 / Qwen3 architecture for
a dense model of their shape, else the folder's own `ModcliForCausalLM` (remote code, `remote/`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.models.decoder import MoDDecoder
from modcli.models.routing.base import ExportedRule, Router

REMOTE = Path(__file__).resolve().parent / "remote"
REMOTE_FILES = ("configuration_modcli.py", "modeling_modcli.py")
AUTO_MAP = {"AutoConfig": "configuration_modcli.ModcliConfig",
            "AutoModelForCausalLM": "modeling_modcli.ModcliForCausalLM"}
PLAIN = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text"}
"""The plain architectures a dense model exports as (transformers' own classes, no remote code)."""


def _routers(model: MoDDecoder) -> list[Router]:
    return [block.router for block in model.blocks if block.router is not None]


def _exported_rules(model: MoDDecoder, routing: str) -> set[ExportedRule | None]:
    """Each routed block's causal rule under `routing`, as its router exports it (None: a block that cannot)."""
    return {router.exported_rule(routing) for router in _routers(model)}


@dataclass
class Converted:
    """What goes into the folder: config.json's contents and the weights, by their names in the folder."""

    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    plain: bool
    """A plain transformers architecture (no remote code)."""
    architecture: str


def refusal(model: MoDDecoder, routing: str) -> str | None:
    """Why the model cannot become a Hugging Face folder, or None."""
    config = model.config
    family = config.family
    if not family.exportable:
        return f"--arch {family.name} cannot be written as a Hugging Face folder: {family.export_note}"
    if config.gemma_options and plain_architecture(config, None) != "Gemma3ForCausalLM":
        return (f"a Hugging Face folder holds {', '.join(config.gemma_options)} (Gemma 3's traits) only as a dense "
                "Gemma3ForCausalLM (q/k norms, norms after each sublayer, GeGLU, scaled embedding; no routing, "
                "experts, drops, q/k/v biases or RoPE scaling); the run works with eval and generate")
    routers = _routers(model)
    if not routers:
        return None
    rules = _exported_rules(model, routing)
    if None in rules:
        exported = [mode for mode in routers[0].modes() if routers[0].exported_rule(mode) is not None]
        return (f"--routing {routing} of the {config.router} router has no Hugging Face form (its modes that have one: "
                + (", ".join(exported) or "none") + ")")
    if len(rules) > 1:  # the folder's config.json holds one rule for every routed block
        return (f"--routing {routing}: the {config.router} router's blocks decide by different rules; a Hugging Face "
                "folder holds one")
    return None


def plain_architecture(config: ModelConfig, source: str | None) -> str | None:
    """The transformers class a model exports as without remote code, or None: a dense model with dense MLPs (an
    early-exit model at its full depth is one). It keeps the architecture it was imported from (`source`), except
    that q/k/v biases without an output bias are Qwen2's layout and q/k norms Qwen3's (both together have no plain
    architecture: Qwen3's attention_bias also biases the output projection)."""
    if not config.dense or config.experts or config.drop:  # a static drop: the folder's own code (no attention)
        return None
    if config.gemma_options:  # Gemma 3's traits: only all of them together, as Gemma 3 has them, have a plain form
        gemma = (config.qk_norm and config.sandwich_norm and config.scale_embeddings and not config.qkv_bias
                 and config.mlp_activation == "gelu-tanh" and config.rope_scaling is None)
        return "Gemma3ForCausalLM" if gemma else None
    if config.qk_norm:
        return None if config.qkv_bias else "Qwen3ForCausalLM"
    if config.qkv_bias:
        return "Qwen2ForCausalLM"
    return source if source in PLAIN else "LlamaForCausalLM"


def norm_eps(config: ModelConfig) -> float:
    """The RMSNorm epsilon as a number: modcli's None is the dtype's machine epsilon (torch.nn.RMSNorm's default),
    float32's for the float32 weights modcli trains."""
    return float(config.norm_eps) if config.norm_eps is not None else float(torch.finfo(torch.float32).eps)


def _rope(config: ModelConfig) -> dict[str, Any]:
    """RoPE in both spellings: transformers 5's `rope_parameters` and the older `rope_theta` / `rope_scaling`."""
    scaling = config.rope_scaling
    parameters = {"rope_type": "default", "rope_theta": config.rope_base}
    if scaling is not None:
        parameters = {**scaling, "rope_type": "llama3", "rope_theta": config.rope_base}
    legacy = {"rope_theta": config.rope_base}
    if scaling is not None:
        legacy["rope_scaling"] = dict(scaling)
    return {"rope_parameters": parameters, **legacy}


def _common(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "intermediate_size": config.hidden, "max_position_embeddings": config.seq_len,
        "tie_word_embeddings": config.tie_embeddings, "dtype": str(dtype).removeprefix("torch."), "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


def convert(model: MoDDecoder, routing: str, source: str | None, dtype: torch.dtype) -> Converted:
    """The folder's config and weights; `source`: the architecture the run was imported from, if any."""
    why = refusal(model, routing)
    if why is not None:
        raise UserError(why)
    config = model.config
    state = {name: (tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()).contiguous()
             for name, tensor in model.state_dict().items()}  # integer buffers (hash routing's table) stay as they are
    architecture = plain_architecture(config, source)
    if architecture == "Gemma3ForCausalLM":
        return Converted(_gemma3_config(config, dtype), _gemma3_state(config, model.state_dict(), dtype), True,
                         architecture)
    if architecture is not None:
        return Converted(_plain_config(config, architecture, dtype), _plain_state(config, state), True, architecture)
    if config.tie_embeddings:
        state.pop("head.weight")  # transformers ties it to embed.weight (_tied_weights_keys)
    remote = {
        "architectures": ["ModcliForCausalLM"], "model_type": "modcli", "auto_map": AUTO_MAP,
        **_common(config, dtype), "rms_norm_eps": config.norm_eps, "rope_base": config.rope_base,
        "llama3_rope_scaling": config.rope_scaling, "qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm,
        "routed_layers": config.routed_layers(), "route_part": "block" if ":" in config.route_part else config.route_part,
        "route_parts": {str(layer): config.route_part_at(layer) for layer in config.routed_layers()},
        "router_weight": config.router_weight,
        "router_hidden": config.router_hidden, "predictor_hidden": config.predictor_hidden,
        "keep_first": config.keep_first, "capacity": config.capacity, "experts": config.experts,
        "expert_top_k": config.expert_top_k, "noop_layers": config.noop_layers(), "noop_experts": config.noop_experts,
        "expert_weight": config.expert_weight, "expert_routing": config.expert_routing,
        "route_decision": "score", "route_cut": 0.0, "route_score": False,
        "dropped_attention": [layer for layer in range(config.n_layers) if config.attention_dropped(layer)],
        "dropped_mlp": [layer for layer in range(config.n_layers) if config.mlp_dropped(layer)],
        "keep_skipped_kv": config.keep_skipped_kv,
        "skip_rank": config.skip_rank if config.skip_update == "linear" else 0,
    }
    if _routers(model):  # the routers' own rule (modcli.models.routing.base.ExportedRule), one by `refusal`
        (rule,) = _exported_rules(model, routing)
        remote.update(route_decision=rule.name, route_cut=rule.cut, route_score=rule.weighted)
    return Converted(remote, state, False, "ModcliForCausalLM")


def _plain_config(config: ModelConfig, architecture: str, dtype: torch.dtype) -> dict[str, Any]:
    model_type = PLAIN[architecture]
    out = {"architectures": [architecture], "model_type": model_type, **_common(config, dtype), **_rope(config),
           "hidden_act": "silu", "rms_norm_eps": norm_eps(config), "attention_dropout": 0.0,
           "initializer_range": 0.02}
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if model_type == "mistral":
        out.update(sliding_window=None)
    if model_type in ("qwen2", "qwen3"):
        out.update(sliding_window=None, use_sliding_window=False, max_window_layers=config.n_layers,
                   layer_types=["full_attention"] * config.n_layers)
    if model_type == "qwen3":
        out.update(attention_bias=False)
    return out


def _gemma3_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A Gemma3TextConfig of the model's shape: its local layers, window and two RoPE bases."""
    layer_types = ["sliding_attention" if config.is_sliding(layer) else "full_attention"
                   for layer in range(config.n_layers)]
    local_base = config.local_rope_base or config.rope_base
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **_common(config, dtype),
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": norm_eps(config), "attention_dropout": 0.0,
            "initializer_range": 0.02, "attention_bias": False, "query_pre_attn_scalar": config.head_dim,
            "sliding_window": config.sliding_window or config.seq_len, "layer_types": layer_types,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": config.rope_base},
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_base}},
            "rope_theta": config.rope_base, "rope_local_base_freq": local_base,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False}


def _gemma3_state(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """modcli's names -> Gemma3ForCausalLM's (the reverse of modcli.pretrained.adapters.Gemma3Adapter.state_dict):
    each RMSNorm weight w back to Gemma's w - 1 (computed in float32, then `dtype`)."""
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(dtype).contiguous()

    def gemma_norm(name: str) -> torch.Tensor:
        return cast(state[name].detach().float() - 1.0)

    out = {"model.embed_tokens.weight": cast(state["embed.weight"]), "model.norm.weight": gemma_norm("norm.weight")}
    if not config.tie_embeddings:
        out["lm_head.weight"] = cast(state["head.weight"])
    sizes = [config.n_heads * config.head_dim] + 2 * [config.kv_heads * config.head_dim]
    norms = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm",
             "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
    for i in range(config.n_layers):
        ours, hf = f"blocks.{i}", f"model.layers.{i}"
        for own, theirs in norms.items():
            out[f"{hf}.{theirs}.weight"] = gemma_norm(f"{ours}.{own}.weight")
        for name, part in zip("qkv", state[f"{ours}.attn.qkv.weight"].split(sizes), strict=True):
            out[f"{hf}.self_attn.{name}_proj.weight"] = cast(part)
        out[f"{hf}.self_attn.o_proj.weight"] = cast(state[f"{ours}.attn.proj.weight"])
        gate, up = state[f"{ours}.mlp.gate_up.weight"].chunk(2)
        out[f"{hf}.mlp.gate_proj.weight"], out[f"{hf}.mlp.up_proj.weight"] = cast(gate), cast(up)
        out[f"{hf}.mlp.down_proj.weight"] = cast(state[f"{ours}.mlp.down.weight"])
    return out


def _plain_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """modcli's names -> transformers' Llama layout: the fused q/k/v and gate/up tensors split (the reverse of
    modcli.pretrained.adapters.LlamaAdapter.state_dict)."""
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    sizes = [config.n_heads * config.head_dim] + 2 * [config.kv_heads * config.head_dim]
    for i in range(config.n_layers):
        ours, hf = f"blocks.{i}", f"model.layers.{i}"
        out[f"{hf}.input_layernorm.weight"] = state[f"{ours}.attn_norm.weight"]
        for name, part in zip("qkv", state[f"{ours}.attn.qkv.weight"].split(sizes), strict=True):
            out[f"{hf}.self_attn.{name}_proj.weight"] = part.contiguous()
        if config.qkv_bias:
            for name, part in zip("qkv", state[f"{ours}.attn.qkv.bias"].split(sizes), strict=True):
                out[f"{hf}.self_attn.{name}_proj.bias"] = part.contiguous()
        if config.qk_norm:
            out[f"{hf}.self_attn.q_norm.weight"] = state[f"{ours}.attn.q_norm.weight"]
            out[f"{hf}.self_attn.k_norm.weight"] = state[f"{ours}.attn.k_norm.weight"]
        out[f"{hf}.self_attn.o_proj.weight"] = state[f"{ours}.attn.proj.weight"]
        out[f"{hf}.post_attention_layernorm.weight"] = state[f"{ours}.mlp_norm.weight"]
        gate, up = state[f"{ours}.mlp.gate_up.weight"].chunk(2)
        out[f"{hf}.mlp.gate_proj.weight"], out[f"{hf}.mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[f"{hf}.mlp.down_proj.weight"] = state[f"{ours}.mlp.down.weight"]
    return out
