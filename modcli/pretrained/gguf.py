"""A llama.cpp GGUF file (Llama, Mistral, Qwen2, Qwen3, Gemma 3) read as the Hugging Face model folder it was
converted from.

`read_gguf(path)` gives what `modcli import` reads from a folder: a config.json-style dict (so the Llama / Qwen2 /
Qwen3 adapter maps it), the tensors under their Hugging Face names, dequantized to float32 one at a time when asked for,
and a tokenizer.json rebuilt from the file's tokenizer metadata. It mirrors transformers' own GGUF loading
(`modeling_gguf_pytorch_utils.py`, `integrations/gguf/gguf_tokenizer_mapping.py`) without importing transformers:
the same names, llama.cpp's Q/K row interleave undone for llama (its converter leaves qwen2 and qwen3 rows, and
Qwen3's per-head q/k norms, as Hugging Face has them), the same tokenizer pieces, so the token ids
are transformers'. One difference: the head size comes from `ARCH.attention.key_length`, which transformers' GGUF
config does not read (a qwen3 file then gets Qwen3Config's default head_dim, 128). Gemma 3 (`gemma3`): llama.cpp
stores its RMSNorm weights as 1 + w, which the reader turns back into w as transformers does; its tokenizer is
transformers' GGUF Gemma tokenizer (`_gemma_bpe`). The `gguf` package is optional and imported only here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modcli.errors import UserError
from modcli.models.decoder import llama3_frequencies

GGUF_EXTRA = 'pip install "modcli[gguf]"'

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
"""GGUF `general.architecture` -> the Hugging Face architecture whose adapter imports it (llama.cpp writes Mistral
as llama)."""

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""The ggml storage types read (dequantized to float32 by `gguf.quants.dequantize`)."""

TOKENIZERS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
"""`tokenizer.ggml.model` values turned into a tokenizer.json."""

_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_OWN_LAYER_TENSORS = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "gemma3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
"""Layer tensors only some architectures have, or name otherwise (Qwen3's and Gemma 3's RMSNorm on each query and
key head; Gemma 3's norms before and after each sublayer)."""
_UNIT_OFFSET_NORMS = ("gemma3",)
"""Architectures whose RMSNorms compute x * (1 + w): llama.cpp's converter stores 1 + w; the reader gives back w,
as Hugging Face has it (transformers' Gemma2TensorProcessor subtracts 1 the same way)."""
_ROPE_FREQS = "rope_freqs.weight"
"""Llama 3.1-style RoPE scaling, which llama.cpp stores as one frequency divisor per rotary pair."""

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
"""`tokenizer.ggml.token_type` values: a piece, a special token (`<|endoftext|>`), an added plain one (`<think>`)."""

# `tokenizer.ggml.pre` -> the regex that splits text before byte-level BPE; others get GPT-2's (transformers'
# GGUF_PRE_TOKENIZER_SPLITS, the same choice).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


class GgufModel:
    """One GGUF file as a Hugging Face checkpoint: `config`, `tensor_names`, `tensor(name)`, `tokenizer_json`."""

    def __init__(self, path: Path, architecture: str, config: dict[str, Any], tensors: dict[str, Any],
                 tokenizer_json: str) -> None:
        self.path = path
        self.architecture = architecture
        """The file's `general.architecture` (llama, qwen2 or qwen3)."""
        self.config = config
        """The model's config.json as Hugging Face would write it (architectures, hidden_size, ...)."""
        self.tokenizer_json = tokenizer_json
        """A tokenizer.json (for the `tokenizers` library) built from the file's tokenizer metadata."""
        self._tensors = tensors  # Hugging Face name -> gguf.ReaderTensor (memory-mapped, not read yet)

    @property
    def tensor_names(self) -> set[str]:
        return set(self._tensors)

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape in Hugging Face's layout, from the file's tensor table (no data read)."""
        return {name: _torch_shape(stored) for name, stored in self._tensors.items()}

    @property
    def field_names(self) -> dict[str, str]:
        """config.json's keys -> the metadata keys they came from, to name a field in an error."""
        key = f"{self.architecture}.{{}}".format
        return {"hidden_size": key("embedding_length"), "num_hidden_layers": key("block_count"),
                "intermediate_size": key("feed_forward_length"), "num_attention_heads": key("attention.head_count"),
                "num_key_value_heads": key("attention.head_count_kv"), "head_dim": key("attention.key_length"),
                "vocab_size": f"{key('vocab_size')} (or the count of tokenizer.ggml.tokens)"}

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor under its Hugging Face name, dequantized to float32 in Hugging Face's layout."""
        if name not in self._tensors:
            raise UserError(f"{self.path}: tensor {name} is missing from the file")
        values = _dequantized(self._tensors[name])
        if self.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                            "k_proj.bias")):
            heads = self.config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            if values.shape[0] != heads * self.config["head_dim"]:
                raise UserError(f"{self.path}: tensor {name} has {values.shape[0]} rows, not {heads} heads x "
                                f"{self.config['head_dim']}")
            values = _undo_rotary_interleave(values, heads)
        if self.architecture in _UNIT_OFFSET_NORMS and name.endswith("norm.weight"):
            values = values - 1.0
        return values


def _dequantized(stored: Any) -> torch.Tensor:
    """A gguf.ReaderTensor's values as a float32 tensor of its torch shape."""
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(stored.data, stored.tensor_type), dtype=np.float32)).reshape(
        _torch_shape(stored))


def _torch_shape(stored: Any) -> tuple[int, ...]:
    return tuple(int(size) for size in reversed(stored.shape))  # ggml lists the fastest dimension first


def read_gguf(path: str | Path) -> GgufModel:
    """Read a GGUF file's metadata and tensor table (no tensor data yet); every problem is one UserError."""
    try:
        import gguf
    except ImportError:
        raise UserError(f"reading a GGUF file needs the gguf package: {GGUF_EXTRA}") from None
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such GGUF file: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct.error... for damaged files
        raise UserError(f"{path}: not a readable GGUF file ({exc})") from None
    metadata = _Metadata(reader, path)
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str) or architecture not in ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {architecture!r} is not supported; supported: "
                        f"{', '.join(ARCHITECTURES)} (llama.cpp writes Mistral as llama)")
    stored = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in TENSOR_TYPES:
            raise UserError(f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which modcli "
                            f"cannot dequantize; supported: {', '.join(TENSOR_TYPES)}")
        stored[tensor.name] = tensor
    tensors = {_hugging_face_name(name, architecture, path): tensor for name, tensor in stored.items()
               if name != _ROPE_FREQS}
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UserError(f"{path}: no tokenizer in the file (tokenizer.ggml.tokens); modcli reads and writes text "
                        "through it")
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise UserError(f"{path}: metadata tokenizer.ggml.tokens must be a list of strings")
    config = _config(metadata, architecture, set(stored), len(tokens))
    if _ROPE_FREQS in stored and "rope_scaling" not in config:
        config["rope_scaling"] = _llama3_scaling(stored[_ROPE_FREQS], config, path)
    return GgufModel(path, architecture, config, tensors, _tokenizer_json(metadata))


class _Metadata:
    """The file's key/value metadata, read key by key (a vocabulary is tens of thousands of strings)."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self.fields:
            raise UserError(f"{self.path}: metadata {key} is missing")
        return self.get(key)

    def uniform(self, key: str, default: Any = None) -> Any:
        """A per-model number that some files store per layer: one value, or a UserError if the layers differ."""
        value = self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UserError(f"{self.path}: {key} differs between layers ({value}); modcli's layers are alike")
            value = value[0]
        return value

    def count(self, key: str, default: Any = None, *, required: bool = False) -> int | None:
        """A positive whole number (a width, a layer or head count; per layer or not), or a UserError naming the
        key: a string, a float, a bool or a number < 1 would fail far from here, when tensors are shaped."""
        if required and key not in self.fields:
            raise UserError(f"{self.path}: metadata {key} is missing")
        value = self.uniform(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{self.path}: metadata {key} must be a positive integer, got {value!r}")
        return value

    def positive(self, key: str, default: Any = None, *, required: bool = False) -> float | None:
        """A positive finite number (an epsilon, a RoPE base), or a UserError naming the key."""
        if required and key not in self.fields:
            raise UserError(f"{self.path}: metadata {key} is missing")
        value = self.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise UserError(f"{self.path}: metadata {key} must be a positive number, got {value!r}")
        return value


def _config(metadata: _Metadata, architecture: str, gguf_names: set[str], n_tokens: int) -> dict[str, Any]:
    """The config.json transformers builds from this file's metadata, with what the adapters check."""
    key = f"{architecture}.{{}}".format
    d_model = metadata.count(key("embedding_length"), required=True)
    heads = metadata.count(key("attention.head_count"), required=True)
    kv_heads = metadata.count(key("attention.head_count_kv"), heads)
    head_dim = metadata.count(key("attention.key_length"))
    if head_dim is None:
        if d_model % heads:
            raise UserError(f"{metadata.path}: metadata {key('attention.head_count')} ({heads}) does not divide "
                            f"{key('embedding_length')} ({d_model}) and no {key('attention.key_length')} gives the "
                            "head size")
        head_dim = d_model // heads
    if heads % kv_heads:
        raise UserError(f"{metadata.path}: metadata {key('attention.head_count_kv')} ({kv_heads}) does not divide "
                        f"{key('attention.head_count')} ({heads})")
    if head_dim % 2:
        raise UserError(f"{metadata.path}: the head size ({head_dim}) must be even for RoPE")
    rotary = metadata.count(key("rope.dimension_count"), head_dim)
    if rotary != head_dim:
        raise UserError(f"{metadata.path}: RoPE on {rotary} of each head's {head_dim} dimensions (partial rotary) is "
                        "not supported")
    sliding_window = metadata.count(key("attention.sliding_window"))
    hugging_face_architecture = ARCHITECTURES[architecture]
    if sliding_window is not None and architecture == "llama":  # Mistral's config names its window
        hugging_face_architecture = "MistralForCausalLM"
    config = {
        "architectures": [hugging_face_architecture],
        "model_type": architecture,
        "hidden_act": "silu",
        "hidden_size": d_model,
        "num_hidden_layers": metadata.count(key("block_count"), required=True),
        "intermediate_size": metadata.count(key("feed_forward_length"), required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": metadata.positive(key("attention.layer_norm_rms_epsilon"), required=True),
        "rope_theta": metadata.positive(key("rope.freq_base"), 10000.0),
        "max_position_embeddings": metadata.count(key("context_length"), 2048),
        "vocab_size": metadata.count(key("vocab_size")) or n_tokens,
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in gguf_names,
        "attention_bias": "blk.0.attn_q.bias" in gguf_names,
        "mlp_bias": any(name.startswith("blk.") and ".ffn_" in name and name.endswith(".bias") for name in gguf_names),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if sliding_window is not None:
        config.update(sliding_window=sliding_window, use_sliding_window=True)
    if architecture == "gemma3":
        # what transformers' GGUF loading leaves at Gemma3TextConfig's defaults: every 6th layer global, local RoPE
        # base 10k; the query scale is head_dim ** -0.5, as llama.cpp computes it for Gemma 3 below 27B
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                      rope_local_base_freq=metadata.positive(key("rope.freq_base_swa"), 10000.0))
    scaling = metadata.get(key("rope.scaling.type"), "none")
    if scaling != "none":  # linear, yarn...: the adapter says which it can represent
        config["rope_scaling"] = {"rope_type": scaling, "factor": metadata.get(key("rope.scaling.factor")),
                                  "original_max_position_embeddings":
                                      metadata.get(key("rope.scaling.original_context_length"))}
    return config


LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Llama 3.1 and 3.2's RoPE scaling apart from its factor; rope_freqs.weight is checked against it."""


def _llama3_scaling(rope_freqs: Any, config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The Llama 3 rope_scaling whose frequency divisors are the file's rope_freqs.weight, or a UserError."""
    divisors = _dequantized(rope_freqs)  # (head_dim/2,)
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), **LLAMA3_SCALING}
    head_dim = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = inv_freq / llama3_frequencies(inv_freq, scaling)  # (head_dim/2,)
    if divisors.shape != expected.shape or not torch.allclose(divisors.double(), expected, rtol=1e-4, atol=0):
        raise UserError(f"{path}: rope_freqs.weight is not Llama 3's RoPE scaling (factor {scaling['factor']:g}, "
                        "low_freq_factor 1, high_freq_factor 4, original context 8192); modcli cannot represent it")
    return scaling


def _hugging_face_name(gguf_name: str, architecture: str, path: Path) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; a tensor outside the architecture's layout is
    a UserError."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    layer_tensors = _LAYER_TENSORS | _OWN_LAYER_TENSORS.get(architecture, {})
    if kind in ("weight", "bias"):
        if len(parts) == 1 and parts[0] in _MODEL_TENSORS:
            return f"{_MODEL_TENSORS[parts[0]]}.{kind}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
            return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
    raise UserError(f"{path}: tensor {gguf_name} is not part of the {architecture} layout modcli imports")


def _undo_rotary_interleave(values: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k (heads * head_dim, ...) from llama.cpp's order back to Hugging Face's.

    llama.cpp's converter interleaves each head's two rotary halves (row i of the first half, row i of the second)
    because ggml rotates adjacent pairs; Hugging Face rotates the halves (transformers' LlamaTensorProcessor)."""
    rows = values.shape[0]
    pairs = values.reshape(heads, rows // heads // 2, 2, *values.shape[1:])  # (H, hd/2, 2, ...)
    return pairs.transpose(1, 2).reshape(values.shape)  # (H, 2, hd/2, ...) -> (H*hd, ...)


def _tokenizer_json(metadata: _Metadata) -> str:
    """The tokenizer.json transformers' GGUF tokenizer would be (its vocabulary, merges, splitting, specials)."""
    from tokenizers import AddedToken, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind not in TOKENIZERS:
        raise UserError(f"{metadata.path}: tokenizer {kind!r} is not supported; supported: "
                        f"{', '.join(f'{name} ({what})' for name, what in TOKENIZERS.items())}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    token_types = _per_token(metadata, "tokenizer.ggml.token_type", len(tokens)) or [_NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens)
        # a control token outside the byte alphabet is a llama.cpp mislabel that transformers skips
        alphabet = set(_byte_spelling().values())
        control = [token for token, token_type in zip(tokens, token_types, strict=True)
                   if token_type == _CONTROL and set(token) <= alphabet]
    elif metadata.get("general.architecture") == "gemma3":
        tokenizer = _gemma_bpe(metadata, tokens)
        control = [token for token, token_type in zip(tokens, token_types, strict=True) if token_type == _CONTROL]
    else:
        tokenizer = _sentencepiece_bpe(metadata, tokens)
        control = [token for token, token_type in zip(tokens, token_types, strict=True) if token_type == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in control])
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                          for token, token_type in zip(tokens, token_types, strict=True)
                          if token_type == _USER_DEFINED and token in vocab])

    def named(key: str) -> tuple[str, int] | None:
        """(token, id) of the special token an id key names, the id as the vocabulary has it."""
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None or not 0 <= token_id < len(tokens):
            return None
        return tokens[token_id], vocab.get(tokens[token_id], token_id)

    special = {key: named(key) for key in ("bos", "eos", "unknown", "padding")}
    # Unlike transformers, a special token the vocabulary spells otherwise (outside the byte alphabet) is not added
    # under a new id past the model's vocabulary; BOS and EOS keep the file's ids.
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                  for token, _ in filter(None, special.values()) if token in vocab])
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")) and special["bos"] is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and special["eos"] is not None
    bos, eos = (special[key][0] if special[key] else "" for key in ("bos", "eos"))
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[special[key] for key, wanted in (("bos", add_bos), ("eos", add_eos)) if wanted])
    return tokenizer.to_str()


def _per_token(metadata: _Metadata, key: str, n_tokens: int) -> list | None:
    """A list the file keeps beside its tokens (types, scores): None if absent, a UserError if of another length."""
    values = metadata.get(key)
    if values is not None and len(values) != n_tokens:
        raise UserError(f"{metadata.path}: {key} has {len(values)} entries for {n_tokens} tokens")
    return values


def _merges(metadata: _Metadata) -> list[tuple[str, str]] | None:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = [tuple(merge.split(" ")) for merge in merges]
    malformed = next((merge for merge, pair in zip(merges, pairs, strict=True) if len(pair) != 2), None)
    if malformed is not None:
        raise UserError(f"{metadata.path}: tokenizer merge {malformed!r} is not two tokens separated by a space")
    return pairs


def _byte_level_bpe(metadata: _Metadata, tokens: list[str]) -> Any:
    """GPT-2-style byte-level BPE (Llama 3, Qwen2, SmolLM): transformers' GPT2Tokenizer from the file's pieces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = _merges(metadata)
    if merges is None:
        raise UserError(f"{metadata.path}: a byte-level BPE tokenizer without merges (tokenizer.ggml.merges)")
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # a token written as text rather than in the byte alphabet is spelled in it, byte by byte
    vocab = {token if set(token) <= alphabet else "".join(spelling[byte] for byte in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(metadata: _Metadata, tokens: list[str]) -> Any:
    """SentencePiece BPE (Llama 2, Mistral): transformers' LlamaTokenizer, merges rebuilt from scores if absent."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _merges(metadata)
    if merges is None:
        scores = _per_token(metadata, "tokenizer.ggml.scores", len(tokens))
        if scores is None:
            raise UserError(f"{metadata.path}: a SentencePiece tokenizer with neither merges nor scores")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1)])
    return tokenizer


def _gemma_bpe(metadata: _Metadata, tokens: list[str]) -> Any:
    """Gemma's SentencePiece BPE as transformers' GGUF loading builds it (GemmaTokenizer, `gemma_tokenizer`): a
    token of spaces only is respelled with U+2581, and the merges, which the file does not hold, are rebuilt with the
    file's order as their rank (Gemma's scores do not follow the merge order); spaces become U+2581 before the
    split, and no prefix space is added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    respelled = ["\u2581" * len(token) if " " in token and not token.strip() else token for token in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    merges = _merges(metadata)
    if merges is None:
        merges = _merges_from_scores(vocab, {token: -index for index, token in enumerate(respelled)})
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unknown] if isinstance(unknown, int) and 0 <= unknown < len(tokens) else "<unk>"
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk_token, dropout=None,
                                     byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scored token first (transformers' `generate_merges`)."""
    merges = []
    for token, score in scores.items():
        splits = [(token[:cut], token[cut:], score) for cut in range(1, len(token))
                  if token[:cut] in vocab and token[cut:] in vocab]
        merges.extend(sorted(splits, key=lambda split: (vocab[split[0]], vocab[split[1]])))
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable character for each byte: the alphabet a byte-level BPE vocabulary is written in."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    unprintable = iter(range(256, 512))
    return {byte: chr(byte) if byte in printable else chr(next(unprintable)) for byte in range(256)}
