"""`modcli export RUN --gguf --out FILE.gguf`: one GGUF file for llama.cpp and transformers' GGUF loader.

What exports: a dense model of the Llama / Mistral / Qwen2 / Qwen3 shape (imported, or trained dense in modcli) as
GGUF's `llama`, `qwen2` or `qwen3` architecture, and a static-drop conversion (`--drop attention:25-29`) of a Llama-
shaped model as `deci`, llama.cpp's architecture with per-layer head counts (0: the layer has no attention).
The tensors go under llama.cpp's names; for `llama` and `deci`, which rotate adjacent pairs of each head (ggml's
"normal" RoPE) where modcli and Hugging Face rotate the two halves, the rows of q and k are interleaved as llama.cpp's
converter does (the inverse of `modcli.pretrained.gguf._undo_rotary_interleave`); `qwen2` and `qwen3` rotate halves
(ggml's NEOX RoPE) and keep the rows. The tokenizer is the run's byte-level BPE tokenizer.json, as
`tokenizer.ggml.model = gpt2` (tokens, token types, merges, the pre-tokenizer's name, BOS/EOS where known).

Refused, each as one UserError line and with nothing written: a routed model (per-token routing has no GGUF form),
MoE, Mixture-of-Recursions, a dropped MLP (llama.cpp's deci graph skips the rest of a layer whose feed-forward length
is 0, its attention update included, and its loader requires that layer's feed-forward tensors), q/k norms or q/k/v
biases in a deci file, q/k/v biases together with q/k norms, RoPE scaling outside Llama's layout, any model field or
weight this writer does not know (a new family's traits: it would otherwise be written wrongly), modcli's built-in
byte tokenizer and tokenizers that are not byte-level BPE.

The file is written beside --out under a temporary name and renamed into place, under --out's lock. Before it is
published it is checked: read back with `gguf.GGUFReader` (architecture, every tensor's name, shape and type), run
by a reference of llama.cpp's graph written here in torch from the file alone (its metadata, its permuted weights,
adjacent-pair RoPE for llama/deci), and, where transformers is installed and knows the architecture (not deci),
loaded with `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`; logits on the check text and on random
tokens are compared with modcli's model whose weights are rounded to the file's storage type (norms stay float32),
within --atol (default 1e-3). A failed check publishes nothing and the command exits 1.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import modcli
from modcli.bundle.config import ExportConfig
from modcli.bundle.hf.card import provenance
from modcli.bundle.hf.convert import norm_eps, plain_architecture
from modcli.bundle.validation import validation_text
from modcli.bundle.writer import Progress, timed_export, write_failed
from modcli.checkpoint import atomic
from modcli.checkpoint.store import load_model_from
from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.models.decoder import MoDDecoder, llama3_frequencies
from modcli.pretrained.gguf import GGUF_EXTRA, PRE_TOKENIZER_SPLITS, read_gguf

GGUF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                      "Qwen3ForCausalLM": "qwen3"}
"""The plain architecture of a dense model -> its GGUF architecture (llama.cpp writes Mistral as llama)."""
PAIR_ROPE = ("llama", "deci")
"""Architectures whose llama.cpp graph rotates adjacent pairs (q/k rows interleaved at export)."""
CHECK_TOKENS = 64
MARKER = "modcli.export"
"""Metadata key naming the modcli version and checkpoint; a file holding it is one --force may replace."""

_KNOWN_FIELDS = {
    # the shape this writer maps
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_size", "qkv_bias", "qk_norm", "norm_eps",
    "rope_scaling", "seq_len", "mlp_hidden", "tie_embeddings", "rope_base", "drop", "experts",
    # routing, experts, training and family options: checked through `dense`, `experts` and the weights
    "capacity", "route_every", "route_offset", "route_layers", "router", "router_weight", "router_hidden",
    "route_part", "predictor_hidden", "keep_first", "keep_skipped_kv", "skip_update", "skip_rank", "dropout",
    "expert_top_k", "expert_capacity_factor", "expert_weight", "noop_experts", "expert_routing", "hash_table", "arch",
    "family_options", "router_options",
}
"""ModelConfig fields this writer knows; any other field away from its default is refused (a trait GGUF would lose)."""

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED = 1, 3, 4, 5
_PRE_NAMES = {"llama3": "llama-bpe", "qwen2": "qwen2", "tekken": "tekken", "gpt-4o": "gpt-4o"}
"""A split regex modcli's GGUF import knows (by its first name there) -> the tokenizer.ggml.pre llama.cpp writes."""


@dataclass
class GGUFCheck:
    runner: str
    """What read the file: gguf reader, llama.cpp reference (torch), transformers."""
    case: str
    max_abs_diff: float | None
    passed: bool
    detail: str = ""


@dataclass
class GGUFExportResult:
    """What `export --gguf` wrote and checked."""

    file: str
    architecture: str
    dtype: str
    atol: float
    bytes: int = 0
    tensors: int = 0
    checks: list[GGUFCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    valid: bool = True
    """Every check passed and the file was published (false: nothing was written)."""
    seconds: float = 0.0
    float32_diff: float | None = None
    """A half-precision file: the reference's largest |logit difference| against modcli's float32 weights
    (information: what storing in --gguf-dtype costs)."""


class _CheckFailed(Exception):
    """Stops publishing the temporary file (the result says why)."""


def export_gguf(config: ExportConfig, log: Callable[[str], None] | None = None) -> GGUFExportResult:
    """Convert, write, check and publish the GGUF file; every user mistake is a UserError and leaves nothing behind."""
    return timed_export(config, _export, log)


def _check_out(out: Path, force: bool) -> tuple | None:
    """An existing --out needs --force, and --force replaces only a GGUF file; returns what is there now."""
    if not out.exists():
        return None
    if not force:
        raise UserError(f"--out {out} already exists; pass --force to replace it")
    if not out.is_file():
        raise UserError(f"--out {out} is not a file; --force replaces only a GGUF file")
    with open(out, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"--force: {out} is not a GGUF file; refusing to replace it")
    return atomic.folder_state(out)


def _export(config: ExportConfig, out: Path, log: Progress) -> GGUFExportResult:
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"--gguf needs the gguf package: {GGUF_EXTRA}")

    expect = _check_out(out, config.force)
    model, run_config, checkpoint = load_model_from(config.checkpoint, "cpu")
    origin = provenance(run_config, checkpoint)
    architecture = gguf_refusal_or_architecture(model, origin.architecture)
    tokenizer = run_config.data.tokenizer
    if tokenizer == "bytes":
        raise UserError("--gguf: the run uses modcli's built-in byte tokenizer (token = byte), which a GGUF file "
                        "cannot express; train the model with a byte-level BPE (`modcli tokenizer train`) or export "
                        "with --onnx or --hf")
    tokenizer_file = checkpoint.parent / tokenizer
    vocabulary = gguf_vocabulary(tokenizer_file, model.config.vocab_size)
    original = _original_metadata(origin.imported_from)
    dtype = config.gguf_dtype
    result = GGUFExportResult(str(out), architecture, dtype, float(config.atol))
    if original.get("note"):
        result.notes.append(original["note"])
    log(f"writing {architecture} ({dtype}) from {checkpoint}")
    try:
        with atomic.publish_file(out, expect=expect) as tmp:
            tensors = write_gguf(tmp, model, architecture, dtype, vocabulary, original,
                                 {"modcli_version": modcli.__version__, "checkpoint": str(checkpoint.resolve())},
                                 out.stem)
            result.tensors, result.bytes = len(tensors), tmp.stat().st_size
            log(f"wrote {len(tensors)} tensors ({result.bytes / 1e6:.2f} MB); checking the file")
            with log.step("checking the file against modcli"):
                check_file(tmp, model, architecture, dtype, tensors, vocabulary, config, result, tokenizer_file)
            if not all(c.passed for c in result.checks):
                result.valid = False
                raise _CheckFailed
            log(f"publishing {out}")
    except _CheckFailed:
        pass
    except Exception as exc:
        failed = write_failed(exc, f"the file {out}")
        if failed is None:
            raise
        raise failed from None
    if result.valid:
        result.bytes = out.stat().st_size
    return result


# ------------------------------------------------------------------------------------------------- what exports


def gguf_refusal_or_architecture(model: MoDDecoder, source: str | None) -> str:
    """The GGUF architecture the model becomes (llama, qwen2, qwen3, deci), or a UserError: one line, the reason."""
    config = model.config
    family = config.family
    if not family.exportable:
        raise UserError(f"--gguf: --arch {family.name} cannot be written as a GGUF file: {family.export_note}")
    if not config.dense:
        raise UserError(f"--gguf: the model is Mixture-of-Depths routed (blocks {_ranges(config.routed_layers())}): "
                        "per-token routing has no GGUF form (llama.cpp runs every token through every block); export "
                        "it with `modcli export --onnx` (modcli-run) or `--hf` (transformers, remote code)")
    if config.experts:
        raise UserError(f"--gguf: a mixture-of-experts MLP (--experts {config.experts}) is not written by modcli's "
                        "GGUF export; use --onnx or --hf")
    gemma = getattr(config, "gemma_options", None)  # the Gemma 3 traits, where this modcli has them
    if gemma:
        raise UserError(f"--gguf: modcli's GGUF export does not write {', '.join(gemma)} (Gemma 3's traits) yet; "
                        "export with --onnx or --hf where they support it")
    unknown = [f.name for f in dataclasses.fields(config)
               if f.name not in _KNOWN_FIELDS and getattr(config, f.name) != _default(f)]
    if unknown:
        raise UserError(f"--gguf: the model sets {', '.join(f'{name}={getattr(config, name)!r}' for name in unknown)}, "
                        "which modcli's GGUF export does not know how to write (Llama, Mistral, Qwen2, Qwen3 shapes "
                        "and attention drops only)")
    dropped_mlp = [layer for layer in range(config.n_layers) if config.mlp_dropped(layer)]
    if dropped_mlp:
        raise UserError(f"--gguf: a dropped MLP (blocks {_ranges(dropped_mlp)}) has no GGUF form: llama.cpp's deci "
                        "graph skips the rest of a layer whose feed-forward length is 0 (its attention update too) and "
                        "its loader requires every layer's feed-forward tensors; only --drop attention:... exports")
    if config.drop:
        if config.qk_norm or config.qkv_bias:
            raise UserError("--gguf: a static-drop model becomes llama.cpp's deci architecture, which has no q/k norms "
                            "(and modcli writes no q/k/v biases into it); this model has "
                            + ("q/k norms (Qwen3)" if config.qk_norm else "q/k/v biases (Qwen2)"))
        architecture = "deci"
    else:
        plain = plain_architecture(config, source)
        if plain is None:
            raise UserError("--gguf: q/k/v biases together with q/k norms have no GGUF architecture (qwen2 has the "
                            "biases, qwen3 the norms)")
        architecture = GGUF_ARCHITECTURES.get(plain, "llama")
    if config.rope_scaling is not None and architecture not in PAIR_ROPE:
        raise UserError(f"--gguf: Llama 3 RoPE scaling in a {architecture} file is not read by llama.cpp's "
                        f"{architecture} graph")
    expected = set(_tensor_names(config, architecture))
    have = {name for name, _ in _gguf_tensors(model, architecture)}
    if have != expected:
        extra = sorted(have - expected) or sorted(expected - have)
        raise UserError(f"--gguf: the model's weights do not fit the {architecture} layout ({', '.join(extra[:3])}"
                        f"{', ...' if len(extra) > 3 else ''}); modcli's GGUF export cannot write them")
    return architecture


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _ranges(layers: list[int]) -> str:
    return ", ".join(map(str, layers))


def _tensor_names(config: ModelConfig, architecture: str) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tie_embeddings:
        names.append("output.weight")
    if config.rope_scaling is not None:
        names.append("rope_freqs.weight")
    for i in range(config.n_layers):
        if not config.attention_dropped(i):
            names += [f"blk.{i}.{p}.weight" for p in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")]
            if config.qkv_bias:
                names += [f"blk.{i}.attn_{p}.bias" for p in "qkv"]
            if config.qk_norm:
                names += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
        names += [f"blk.{i}.{p}.weight" for p in ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    return names


def _interleave_rotary(values: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k (heads * head_dim, ...) from Hugging Face's order (two halves per head) to llama.cpp's
    (adjacent pairs): llama.cpp's converter `permute`, the inverse of the import's `_undo_rotary_interleave`."""
    rows = values.shape[0]
    halves = values.reshape(heads, 2, rows // heads // 2, *values.shape[1:])  # (H, 2, hd/2, ...)
    return halves.transpose(1, 2).reshape(values.shape)  # (H, hd/2, 2, ...) -> (H*hd, ...)


def _gguf_tensors(model: MoDDecoder, architecture: str) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp name, float32 tensor in torch's layout) for every weight; names the model has beyond the layout
    come out under their own modcli name, so that the caller refuses them."""
    config = model.config
    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    out: list[tuple[str, torch.Tensor]] = [("token_embd.weight", state.pop("embed.weight")),
                                           ("output_norm.weight", state.pop("norm.weight"))]
    head = state.pop("head.weight", None)
    if not config.tie_embeddings:
        out.append(("output.weight", head))
    if config.rope_scaling is not None:
        out.append(("rope_freqs.weight", rope_divisors(config)))
    sizes = [config.n_heads * config.head_dim] + 2 * [config.kv_heads * config.head_dim]
    pairs = architecture in PAIR_ROPE
    for i in range(config.n_layers):
        ours, blk = f"blocks.{i}", f"blk.{i}"
        if f"{ours}.attn.qkv.weight" in state:
            out.append((f"{blk}.attn_norm.weight", state.pop(f"{ours}.attn_norm.weight")))
            for kind in ("weight", "bias"):
                fused = state.pop(f"{ours}.attn.qkv.{kind}", None)
                if fused is None:
                    continue
                q, k, v = fused.split(sizes)
                if pairs:
                    q, k = _interleave_rotary(q, config.n_heads), _interleave_rotary(k, config.kv_heads)
                out += [(f"{blk}.attn_q.{kind}", q), (f"{blk}.attn_k.{kind}", k), (f"{blk}.attn_v.{kind}", v)]
            for part in ("q", "k"):
                norm = state.pop(f"{ours}.attn.{part}_norm.weight", None)
                if norm is not None:
                    out.append((f"{blk}.attn_{part}_norm.weight", norm))
            out.append((f"{blk}.attn_output.weight", state.pop(f"{ours}.attn.proj.weight")))
        if f"{ours}.mlp.gate_up.weight" in state:
            out.append((f"{blk}.ffn_norm.weight", state.pop(f"{ours}.mlp_norm.weight")))
            gate, up = state.pop(f"{ours}.mlp.gate_up.weight").chunk(2)
            out += [(f"{blk}.ffn_gate.weight", gate), (f"{blk}.ffn_up.weight", up),
                    (f"{blk}.ffn_down.weight", state.pop(f"{ours}.mlp.down.weight"))]
    out += sorted(state.items())  # anything left has no place in the layout
    return out


def rope_divisors(config: ModelConfig) -> torch.Tensor:
    """llama.cpp's rope_freqs.weight: each rotary pair's frequency divisor under Llama 3's scaling."""
    head_dim = config.head_dim
    inv_freq = 1.0 / config.rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (inv_freq / llama3_frequencies(inv_freq, config.rope_scaling)).float()  # (head_dim/2,)


# ---------------------------------------------------------------------------------------------------- tokenizer


@dataclass
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos: int | None = None
    eos: int | None = None


def gguf_vocabulary(tokenizer_file: Path, vocab_size: int) -> Vocabulary:
    """The run's tokenizer.json as GGUF's gpt2 tokenizer, or a UserError saying what GGUF cannot express."""
    try:
        spec = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"--gguf: cannot read the run's tokenizer {tokenizer_file}: {exc}") from None
    model = spec.get("model") or {}
    cannot = f"--gguf: the run's tokenizer ({tokenizer_file.name}) cannot be written as GGUF's byte-level BPE (gpt2): "
    if model.get("type") != "BPE" or model.get("byte_fallback") or spec.get("normalizer") is not None:
        raise UserError(cannot + "it is not a byte-level BPE without normalizer (SentencePiece tokenizers are not "
                                 "exported)")
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    if pre is None:
        raise UserError(cannot + "its pre-tokenizer is not a ByteLevel one (with GPT-2's split or a split llama.cpp "
                                 "names)")
    tokens: dict[int, str] = {index: token for token, index in model.get("vocab", {}).items()}
    types = dict.fromkeys(tokens, _TOKEN_NORMAL)
    for added in spec.get("added_tokens") or []:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = _TOKEN_CONTROL if added.get("special") else _TOKEN_USER_DEFINED
    if tokens and max(tokens) >= vocab_size:
        raise UserError(cannot + f"it has token ids up to {max(tokens)}, past the model's vocabulary ({vocab_size})")
    listed = [tokens.get(index, f"[PAD{index}]") for index in range(vocab_size)]
    listed_types = [types.get(index, _TOKEN_UNUSED) for index in range(vocab_size)]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges") or []]
    return Vocabulary(listed, listed_types, merges, pre)


def _pre_tokenizer_name(pre: dict | None) -> str | None:
    """tokenizer.ggml.pre for a tokenizer.json pre-tokenizer: gpt2 (ByteLevel with its own regex), or the name of a
    split regex followed by a ByteLevel without one; None if llama.cpp has no name for it."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        return "gpt2" if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return None
    split, byte_level = pre["pretokenizers"]
    if (split.get("type") != "Split" or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
            or byte_level.get("add_prefix_space")):
        return None
    pattern = (split.get("pattern") or {}).get("Regex")
    names = {regex: name for name, regex in reversed(PRE_TOKENIZER_SPLITS.items())}  # the first name wins
    return _PRE_NAMES.get(names.get(pattern, ""))


def _original_metadata(imported_from: str | None) -> dict[str, Any]:
    """BOS/EOS ids and the context length of the model the run was imported from (its config.json or GGUF file),
    where that file is still there; {} otherwise (the file then has the run's context and no BOS/EOS)."""
    if not imported_from:
        return {}
    path = Path(imported_from)
    try:
        if path.is_file():
            hf = read_gguf(path).config
        elif (path / "config.json").is_file():
            hf = json.loads((path / "config.json").read_text())
        else:
            return {"note": f"the imported original {path} is gone: no BOS/EOS ids in the file"}
    except (UserError, OSError, ValueError):
        return {"note": f"the imported original {path} could not be read: no BOS/EOS ids in the file"}

    def first(value: Any) -> int | None:
        value = value[0] if isinstance(value, list) and value else value
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return {"bos": first(hf.get("bos_token_id")), "eos": first(hf.get("eos_token_id")),
            "context": first(hf.get("max_position_embeddings"))}


# ------------------------------------------------------------------------------------------------------- writing


def _stored(values: torch.Tensor, dtype: str) -> tuple[np.ndarray, Any]:
    """(array, ggml type) of one tensor: 1-D tensors (norms, rope_freqs) stay float32."""
    from gguf import GGMLQuantizationType, quants

    data = values.float().contiguous().numpy()
    if values.ndim == 1 or dtype == "float32":
        return data, GGMLQuantizationType.F32
    if dtype == "float16":
        return data.astype(np.float16), GGMLQuantizationType.F16
    return quants.quantize(data, GGMLQuantizationType.BF16), GGMLQuantizationType.BF16


def round_like_file(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """The float32 values the file holds for `values` (what a reader dequantizes)."""
    if values.ndim == 1 or dtype == "float32":
        return values.float()
    return values.to({"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]).float()


def write_gguf(path: Path, model: MoDDecoder, architecture: str, dtype: str, vocabulary: Vocabulary,
               original: dict[str, Any], record: dict[str, str], name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Write the file at `path`; returns each tensor's name -> (torch shape, ggml type name)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(path=None, arch=architecture)
    writer.add_name(name)
    writer.add_string(MARKER, json.dumps(record))
    drops = architecture == "deci"
    heads = [0 if config.attention_dropped(i) else config.n_heads for i in range(config.n_layers)]
    kv_heads = [0 if config.attention_dropped(i) else config.kv_heads for i in range(config.n_layers)]
    writer.add_context_length(int(original.get("context") or config.seq_len))
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length([config.hidden] * config.n_layers if drops else config.hidden)
    writer.add_head_count(heads if drops else config.n_heads)
    writer.add_head_count_kv(kv_heads if drops else config.kv_heads)
    writer.add_rope_freq_base(float(config.rope_base))
    writer.add_layer_norm_rms_eps(norm_eps(config))
    writer.add_rope_dimension_count(config.head_dim)
    if drops or config.head_dim * config.n_heads != config.d_model:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type({"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                          "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.token_types)
    writer.add_token_merges(vocabulary.merges)
    for key, token_id in (("bos", original.get("bos")), ("eos", original.get("eos"))):
        if token_id is not None and 0 <= token_id < config.vocab_size:
            getattr(writer, f"add_{key}_token_id")(token_id)
    writer.add_add_bos_token(False)  # modcli's tokenizer adds none; neither should llama.cpp
    shapes = {}
    for tensor_name, values in _gguf_tensors(model, architecture):
        data, kind = _stored(values, dtype)
        writer.add_tensor(tensor_name, data, raw_dtype=kind)
        shapes[tensor_name] = (tuple(values.shape), kind.name)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return shapes


# ------------------------------------------------------------------------------------------------------ checking


def check_file(path: Path, model: MoDDecoder, architecture: str, dtype: str,
               tensors: dict[str, tuple[tuple[int, ...], str]], vocabulary: Vocabulary, config: ExportConfig,
               result: GGUFExportResult, tokenizer_file: Path) -> None:
    """Read the file back, run it, compare it with modcli: the checks go to `result.checks` (notes to `notes`)."""
    atol = float(config.atol)
    read = GGUFFile(path)
    problems = read.mismatches(architecture, tensors, len(vocabulary.tokens))
    result.checks.append(GGUFCheck("gguf reader", f"metadata, {len(tensors)} tensors", None, not problems,
                                   "; ".join(problems[:3])))
    if problems:
        return
    cases = _check_cases(model.config, config, tokenizer_file)
    rounded = _rounded_model(model, dtype)
    with torch.no_grad():
        expected = {case: rounded(tokens).double() for case, tokens in cases}
        worst_float32 = 0.0
        for case, tokens in cases:
            got = read.reference_logits(tokens)
            diff = (got - expected[case]).abs().max().item()
            result.checks.append(GGUFCheck("llama.cpp reference (torch)", case, diff, diff <= atol))
            if dtype != "float32":
                worst_float32 = max(worst_float32, (got - model(tokens).double()).abs().max().item())
        if dtype != "float32":
            result.float32_diff = worst_float32
        if architecture == "deci":
            result.notes.append("transformers has no model class for GGUF's deci architecture: the file was checked "
                                "by the reference of llama.cpp's deci graph only")
        elif importlib.util.find_spec("transformers") is None:
            result.notes.append("transformers is not installed: the file was not loaded with its GGUF loader")
        elif importlib.util.find_spec("accelerate") is None:  # from_pretrained(gguf_file=...) insists on it
            result.notes.append("transformers' GGUF loader needs accelerate (pip install accelerate), which is not "
                                "installed: the file was not loaded with it")
        else:
            hf, notes = _transformers_model(path, model.config)
            result.notes += notes
            for case, tokens in cases:
                diff = (hf(tokens).logits.double() - expected[case]).abs().max().item()
                result.checks.append(GGUFCheck(f"transformers {_version('transformers')}", case, diff, diff <= atol))


def _version(package: str) -> str:
    return importlib.import_module(package).__version__


def _check_cases(model_config: ModelConfig, config: ExportConfig, tokenizer_file: Path
                 ) -> list[tuple[str, torch.Tensor]]:
    """The check text through the run's tokenizer (at most CHECK_TOKENS, within the context) and random tokens."""
    from tokenizers import Tokenizer

    length = min(CHECK_TOKENS, model_config.seq_len)
    raw = validation_text(config.text, 256).astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    ids = Tokenizer.from_file(str(tokenizer_file)).encode(raw[:20 * length]).ids[:length]
    ids = [token % model_config.vocab_size for token in ids] or [0]
    generator = torch.Generator().manual_seed(config.seed)
    random = torch.randint(0, model_config.vocab_size, (2, min(32, model_config.seq_len)), generator=generator)
    return [(f"text T={len(ids)}", torch.tensor([ids])), (f"random B=2 T={random.shape[1]}", random)]


def _rounded_model(model: MoDDecoder, dtype: str) -> MoDDecoder:
    """modcli's model with every weight the file stores in `dtype` rounded to it (computing in float32)."""
    if dtype == "float32":
        return model
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(round_like_file(parameter, dtype))
    return rounded


def _transformers_model(path: Path, config: ModelConfig) -> tuple[Any, list[str]]:
    """The file loaded by transformers' GGUF loader (float32), with the two fields that loader does not read from
    GGUF set from the file's own metadata (named in the notes)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # its progress bar and "keys not parsed" lines
    folder, name = str(path.parent), path.name
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    notes = []
    if getattr(hf_config, "head_dim", config.head_dim) != config.head_dim:
        notes.append(f"transformers' GGUF loader does not read {hf_config.model_type}.attention.key_length (it made "
                     f"head_dim {hf_config.head_dim}); the check set head_dim {config.head_dim} from the file")
        hf_config.head_dim = config.head_dim
    if config.rope_scaling is not None:
        notes.append("transformers' GGUF loader does not read rope_freqs.weight (Llama 3 RoPE scaling); the check set "
                     "it from the run")
        hf_config.rope_parameters = {**config.rope_scaling, "rope_theta": config.rope_base}
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):  # tqdm's bar over the tensors
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=hf_config, dtype=torch.float32)
    return hf.eval(), notes


class GGUFFile:
    """A GGUF file read back: its metadata and tensors, and llama.cpp's graph for it in torch (float64)."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.reader = gguf.GGUFReader(path)
        self.architecture = self.get("general.architecture")
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, key: str, default: Any = None) -> Any:
        found = self.reader.fields.get(key)
        return default if found is None else found.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> torch.Tensor | None:
        if name not in self._cache:
            from gguf.quants import dequantize

            stored = next((t for t in self.reader.tensors if t.name == name), None)
            if stored is None:
                return None
            shape = tuple(int(size) for size in reversed(stored.shape))
            self._cache[name] = torch.from_numpy(
                np.array(dequantize(stored.data, stored.tensor_type), dtype=np.float64)).reshape(shape)
        return self._cache[name]

    def mismatches(self, architecture: str, tensors: dict[str, tuple[tuple[int, ...], str]], n_tokens: int
                   ) -> list[str]:
        """What the file says otherwise than what was written: the architecture, each tensor's shape and type, the
        vocabulary's size."""
        problems = []
        if self.architecture != architecture:
            problems.append(f"general.architecture is {self.architecture!r}, not {architecture!r}")
        stored = {t.name: (tuple(int(s) for s in reversed(t.shape)), t.tensor_type.name) for t in self.reader.tensors}
        if set(stored) != set(tensors):
            problems.append(f"tensors differ: {sorted(set(stored) ^ set(tensors))[:3]}")
        problems += [f"{name} is {stored[name]}, not {wanted}" for name, wanted in tensors.items()
                     if name in stored and stored[name] != wanted]
        if len(self.get("tokenizer.ggml.tokens", [])) != n_tokens:
            problems.append("tokenizer.ggml.tokens has another length")
        return problems

    def _per_layer(self, key: str, n_layers: int) -> list[int]:
        value = self.arch(key)
        return list(value) if isinstance(value, list) else [value] * n_layers

    def reference_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, V): llama.cpp's llama / deci / qwen2 / qwen3 graph over the file's tensors, in float64."""
        n_layers, eps = self.arch("block_count"), self.arch("attention.layer_norm_rms_epsilon")
        heads = self._per_layer("attention.head_count", n_layers)
        kv_heads = self._per_layer("attention.head_count_kv", n_layers)
        head_dim = self.arch("attention.key_length") or self.arch("embedding_length") // max(heads)
        base = self.arch("rope.freq_base", 10000.0)
        pairs = self.architecture in PAIR_ROPE
        divisors = self.tensor("rope_freqs.weight")
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hd/2,)
        if divisors is not None:
            inv_freq = inv_freq / divisors
        batch, length = tokens.shape
        angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq  # (T, hd/2)
        cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]  # (1, T, 1, hd/2)

        def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

        def rope(x: torch.Tensor) -> torch.Tensor:  # (B, T, H, hd)
            if pairs:  # ggml's normal mode: (x[2i], x[2i+1])
                even, odd = x[..., 0::2], x[..., 1::2]
                return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
            first, second = x.chunk(2, dim=-1)  # NEOX: (x[i], x[i + hd/2])
            return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

        def linear(x: torch.Tensor, name: str) -> torch.Tensor:
            bias = self.tensor(name.replace(".weight", ".bias"))
            out = x @ self.tensor(name).T
            return out if bias is None else out + bias

        causal = torch.ones(length, length, dtype=torch.bool).tril()
        x = self.tensor("token_embd.weight")[tokens]  # (B, T, D)
        for i in range(n_layers):
            blk = f"blk.{i}"
            if heads[i] > 0:
                h = rms(x, self.tensor(f"{blk}.attn_norm.weight"))
                q = linear(h, f"{blk}.attn_q.weight").view(batch, length, heads[i], head_dim)
                k = linear(h, f"{blk}.attn_k.weight").view(batch, length, kv_heads[i], head_dim)
                v = linear(h, f"{blk}.attn_v.weight").view(batch, length, kv_heads[i], head_dim)
                if self.tensor(f"{blk}.attn_q_norm.weight") is not None:
                    q, k = rms(q, self.tensor(f"{blk}.attn_q_norm.weight")), rms(k, self.tensor(f"{blk}.attn_k_norm.weight"))
                q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)  # (B, H, T, hd), (B, Hkv, T, hd)
                group = heads[i] // kv_heads[i]
                k, v = k.repeat_interleave(group, dim=1), v.transpose(1, 2).repeat_interleave(group, dim=1)
                scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)  # (B, H, T, T)
                weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
                attended = (weights @ v).transpose(1, 2).reshape(batch, length, heads[i] * head_dim)
                x = x + linear(attended, f"{blk}.attn_output.weight")
            h = rms(x, self.tensor(f"{blk}.ffn_norm.weight"))
            gated = torch.nn.functional.silu(linear(h, f"{blk}.ffn_gate.weight")) * linear(h, f"{blk}.ffn_up.weight")
            x = x + linear(gated, f"{blk}.ffn_down.weight")
        x = rms(x, self.tensor("output_norm.weight"))
        head = self.tensor("output.weight")
        return x @ (self.tensor("token_embd.weight") if head is None else head).T  # (B, T, V)
