"""GGUF files: tiny llama.cpp-style files written with `gguf.GGUFWriter` read by modcli.pretrained.gguf give
transformers' own GGUF loading (its config, its dequantized and renamed tensors, its tokenizer's ids), the weights
that were written, and the same logits through the Llama / Qwen2 / Qwen3 adapter; bad files are one UserError each.

transformers' `from_pretrained(gguf_file=...)` insists on `accelerate` (not a modcli dependency) before it calls
`load_gguf_checkpoint`, so the reference here is that function, given the model transformers builds from the same
file's config, exactly as `from_pretrained` does for llama, qwen2 and qwen3."""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from modcli.errors import UserError
from modcli.pretrained.gguf import TENSOR_TYPES, read_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

D_MODEL, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 256
HEAD_DIM = D_MODEL // HEADS
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""Types gguf-py cannot quantize into: written as random blocks (every value a real number) instead."""

TEXT = ("The GNU General Public License is a free, copyleft license for software and other kinds of works.\n"
        "def f_12(x):\n\treturn x * 3 + 1024  # naïve café, déjà vu, Straße\n"
        "<|im_start|>user\nWhat's 2+2? I'm sure it's 4; they'll say so.<|im_end|>\n"
        "日本語のテキスト、中文文本 🙂🚀   trailing spaces   \r\n\n  indented\u00a0nbsp <|endoftext|>")

# The Hugging Face layout each GGUF tensor comes from (written out here, not taken from the module under test).
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

# (architecture, tied embeddings, q/k/v biases, tokenizer.ggml.pre, storage type of each kind of tensor); qwen3 files
# also hold q/k norms (`hugging_face_tensors`)
MODELS = {
    # GQA, untied head, the llama3 pre-tokenizer split, every block type gguf-py can quantize into
    "llama": ("llama", False, False, "llama-bpe", {
        "token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0",
        "attn_output": "Q5_1", "ffn_gate": "Q8_0", "ffn_up": "Q4_0", "ffn_down": ("Q4_K", "Q6_K")}),
    # q/k/v biases, tied embeddings, no Q/K row interleave
    "qwen2": ("qwen2", True, True, "qwen2", {
        "token_embd": "Q8_0", "attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q8_0",
        "ffn_gate": "Q5_1", "ffn_up": "Q5_0", "ffn_down": ("Q5_K", "Q3_K")}),
    # q/k norms (F32, as llama.cpp keeps every norm), tied embeddings, no biases, no Q/K row interleave either
    "qwen3": ("qwen3", True, False, "qwen2", {
        "token_embd": "Q8_0", "attn_q": "F32", "attn_k": "F32", "attn_v": "Q8_0", "attn_output": "F16",
        "ffn_gate": "Q8_0", "ffn_up": "Q4_0", "ffn_down": ("Q6_K", "Q8_0")}),
    # float files: F32 q/k (the interleave undone exactly), half precision elsewhere, GPT-2's default split
    "llama-float": ("llama", True, False, "smollm", {
        "token_embd": "F16", "attn_q": "F32", "attn_k": "F32", "attn_v": "BF16", "attn_output": "F16",
        "ffn_gate": "BF16", "ffn_up": "F16", "ffn_down": ("Q2_K", "F32")}),
}


@cache
def byte_level_vocabulary() -> tuple[list[str], list[str]]:
    """A real little byte-level BPE (~300 tokens, three control tokens first): tokens by id, merges by rank."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tests.conftest import make_corpus_text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([make_corpus_text(60), TEXT * 3], trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return sorted(model["vocab"], key=model["vocab"].get), [" ".join(merge) for merge in model["merges"]]


@cache
def sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A Llama-2-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, then BPE pieces scored by rank; no merges."""
    from tokenizers import SentencePieceBPETokenizer

    from tests.conftest import make_corpus_text

    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator([make_corpus_text(60), TEXT * 3], vocab_size=160, limit_alphabet=60)
    vocab = json.loads(trained._tokenizer.to_str())["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))]
    token_types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # unknown, control, byte, normal
    return tokens, scores, token_types


def hugging_face_tensors(vocab_size: int, tied: bool, qkv_bias: bool, seed: int,
                         qk_norm: bool = False) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face's names and layout (`qk_norm`: Qwen3's q_norm and k_norm too)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, D_MODEL), "model.norm.weight": 1 + normal(D_MODEL)}
    if not tied:
        tensors["lm_head.weight"] = normal(vocab_size, D_MODEL)
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        tensors |= {f"{layer}.input_layernorm.weight": 1 + normal(D_MODEL),
                    f"{layer}.post_attention_layernorm.weight": 1 + normal(D_MODEL),
                    f"{layer}.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, D_MODEL),
                    f"{layer}.self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, D_MODEL),
                    f"{layer}.self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, D_MODEL),
                    f"{layer}.self_attn.o_proj.weight": normal(D_MODEL, HEADS * HEAD_DIM),
                    f"{layer}.mlp.gate_proj.weight": normal(FFN, D_MODEL),
                    f"{layer}.mlp.up_proj.weight": normal(FFN, D_MODEL),
                    f"{layer}.mlp.down_proj.weight": normal(D_MODEL, FFN)}
        if qkv_bias:
            tensors |= {f"{layer}.self_attn.{p}_proj.bias": normal(size)
                        for p, size in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM))}
        if qk_norm:
            tensors |= {f"{layer}.self_attn.{p}_norm.weight": 1 + normal(HEAD_DIM) for p in "qk"}
    return tensors


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: each head's rotary halves interleaved row by row."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def gguf_name(name: str) -> tuple[str, str]:
    """A Hugging Face tensor name -> (GGUF name, its kind in MODELS' storage plans)."""
    parts = name.split(".")
    if parts[1] == "layers":
        kind = next(g for g, h in LAYER_NAMES.items() if ".".join(parts[3:-1]) == h)
        return f"blk.{parts[2]}.{kind}.{parts[-1]}", kind
    kind = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
        name.rsplit(".", 1)[0]]
    return f"{kind}.{parts[-1]}", kind


def add_stored(writer, name: str, values: np.ndarray, storage: str, rng: np.random.Generator) -> None:
    qtype = gguf.GGMLQuantizationType[storage]
    if storage == "F32":
        writer.add_tensor(name, values)
    elif storage == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    elif storage in K_QUANTS:
        # high bytes below 0x3C keep every float16 scale finite and under 1
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, columns = values.shape
        writer.add_tensor(name, rng.integers(0, 0x3C, (rows, columns // block * size), dtype=np.uint8),
                          raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


HYPER_PARAMETERS = dict(block_count=LAYERS, context_length=256, embedding_length=D_MODEL, feed_forward_length=FFN,
                        head_count=HEADS, head_count_kv=KV_HEADS, layer_norm_rms_eps=1e-5, rope_freq_base=50000.0,
                        rope_dimension_count=HEAD_DIM)
"""The model's metadata, as `GGUFWriter.add_<key>` calls."""


def byte_level_tokenizer(pre: str = "smollm", tokens: list[str] | None = None, merges: list[str] | None = None,
                         token_types: list[int] | None = None, bos: int = 1, pad: int = 2, add_bos: bool = False,
                         model: str = "gpt2"):
    """Writes a gpt2-model tokenizer the way llama.cpp does (default: the little BPE, its three specials control)."""
    if tokens is None:
        tokens, merges = byte_level_vocabulary()
        token_types = [3] * 3 + [1] * (len(tokens) - 3)

    def write(writer) -> None:
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types(token_types)
        writer.add_bos_token_id(bos)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(pad)
        writer.add_add_bos_token(add_bos)
        writer.add_vocab_size(len(tokens))
    return write


def sentencepiece_tokenizer(writer) -> None:
    tokens, scores, token_types = sentencepiece_vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_vocab_size(len(tokens))


def write_gguf(path: Path, architecture: str, tensors: dict[str, np.ndarray], plan: dict, tokenizer=None,
               extra_tensors=(), raw_metadata=None, **metadata) -> dict[str, str]:
    """A GGUF file as llama.cpp's converter writes one; `metadata` replaces or adds to HYPER_PARAMETERS (a value of
    None leaves the key out); `raw_metadata`: {key: value} written as they are, of the value's GGUF type. Returns
    each Hugging Face tensor's storage type."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test model")
    for key, value in (HYPER_PARAMETERS | metadata).items():
        if value is not None:
            getattr(writer, f"add_{key}")(value)
    for key, value in (raw_metadata or {}).items():
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)](key, value)
    (tokenizer or byte_level_tokenizer())(writer)
    rng = np.random.default_rng(7)
    storage = {}
    for name, values in tensors.items():
        target, kind = gguf_name(name)
        if architecture == "llama" and kind in ("attn_q", "attn_k"):
            values = llama_cpp_permute(values, HEADS if kind == "attn_q" else KV_HEADS)
        chosen = plan.get(kind, "F32")
        if isinstance(chosen, tuple):  # one type per layer
            chosen = chosen[int(name.split(".")[2])]
        storage[name] = chosen if values.ndim == 2 else "F32"  # llama.cpp keeps norms and biases in F32
        add_stored(writer, target, values, storage[name], rng)
    for name, values in extra_tensors:
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return storage


def test_the_models_store_every_supported_type():
    stored = {"F32"}  # norms
    for *_, plan in MODELS.values():
        for chosen in plan.values():
            stored.update(chosen if isinstance(chosen, tuple) else (chosen,))
    assert stored == set(TENSOR_TYPES)


@pytest.fixture(scope="module", params=list(MODELS))
def gguf_model(request, tmp_path_factory):
    """(name, path, Hugging Face tensors written, storage type of each)."""
    architecture, tied, qkv_bias, pre, plan = MODELS[request.param]
    tokens, _ = byte_level_vocabulary()
    tensors = hugging_face_tensors(len(tokens), tied, qkv_bias, seed=len(request.param),
                                   qk_norm=architecture == "qwen3")
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    head_size = dict(key_length=HEAD_DIM, value_length=HEAD_DIM) if architecture == "qwen3" else {}  # as llama.cpp
    storage = write_gguf(path, architecture, tensors, plan, byte_level_tokenizer(pre), **head_size)
    return request.param, path, tensors, storage


def transformers_load(path: Path):
    """(config, model with the file's weights, its state dict as load_gguf_checkpoint dequantized it)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if config.model_type == "qwen3":  # transformers' GGUF config skips the head size, left at Qwen3Config's 128
        config.head_dim = gguf.GGUFReader(path).fields["qwen3.attention.key_length"].contents()
    model = AutoModelForCausalLM.from_config(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    return config, model, tensors


def test_the_state_dict_and_config_are_transformers_own(gguf_model):
    name, path, written, storage = gguf_model
    config, _, reference = transformers_load(path)
    model = read_gguf(path)
    assert model.tensor_names == set(reference) == set(written)
    for tensor_name, values in reference.items():
        ours = model.tensor(tensor_name)
        assert ours.dtype == torch.float32 and ours.shape == values.shape, tensor_name
        torch.testing.assert_close(ours, values, atol=1e-6, rtol=0, msg=tensor_name)
    hf = model.config
    assert hf["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[config.model_type]]
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert hf[key] == getattr(config, key), key
    assert hf["rope_theta"] == config.rope_parameters["rope_theta"] == 50000.0
    assert hf["head_dim"] == HEAD_DIM and hf["tie_word_embeddings"] == (name != "llama")
    assert hf["attention_bias"] == (name == "qwen2")


def test_the_tensors_are_the_weights_that_were_written(gguf_model):
    """Independent of transformers: F32 tensors (llama's Q/K interleave undone) come back bit for bit, Q8_0 ones
    within a block's rounding step, all in Hugging Face's layout."""
    _, path, written, storage = gguf_model
    model = read_gguf(path)
    checked = set()
    for name, values in written.items():
        original = torch.from_numpy(values)
        if storage[name] == "F32":
            assert torch.equal(model.tensor(name), original), name
        elif storage[name] == "Q8_0":  # 32 values share a scale of max|x| / 127
            step = original.abs().reshape(original.shape[0], -1, 32).amax(-1).max() / 127
            assert (model.tensor(name) - original).abs().max() <= step, name
        else:
            continue
        checked.add(name)
    assert len(checked) >= 5
    if storage["model.layers.0.self_attn.q_proj.weight"] == "F32":
        assert {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(LAYERS) for p in "qk"} <= checked


def test_the_adapter_imports_the_same_logits(gguf_model):
    """Through the Llama / Qwen2 / Qwen3 adapter (what `modcli import` does), modcli's model is transformers'."""
    from modcli.models.decoder import MoDDecoder
    from modcli.pretrained.adapters import ADAPTERS

    _, path, _, _ = gguf_model
    _, reference, _ = transformers_load(path)
    model = read_gguf(path)
    adapter = ADAPTERS[model.config["architectures"][0]]
    config = adapter.model_config(model.config, 64, model.tensor_names)
    ours = MoDDecoder(config).eval()
    missing, unexpected = ours.load_state_dict(adapter.state_dict(config, model.tensor), strict=False)
    assert not unexpected and all(".router" in key or key == "head.weight" for key in missing)
    if config.tie_embeddings:
        ours.head.weight = ours.embed.weight
    tokens = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens).logits, atol=1e-4, rtol=0)


def assert_same_ids(path: Path, model) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_str(model.tokenizer_json)
    assert len(TEXT) > 300
    for text in (TEXT, " leading space", TEXT[150:]):
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False).ids == reference(text, add_special_tokens=False)[
            "input_ids"]
        assert max(ids) < model.config["vocab_size"]
    # the whole tokenizer is transformers', not only these ids
    assert json.loads(model.tokenizer_json) == json.loads(reference.backend_tokenizer.to_str())


def test_byte_level_token_ids_are_transformers_own(gguf_model):
    from tokenizers import Tokenizer

    _, path, _, _ = gguf_model
    model = read_gguf(path)
    assert_same_ids(path, model)
    ours = Tokenizer.from_str(model.tokenizer_json)
    ids = ours.encode(TEXT).ids
    assert ours.decode(ids, skip_special_tokens=False) == TEXT  # byte-level BPE round-trips any text
    assert ids.count(1) == 1 and ids.count(2) == 1  # <|im_start|>, <|im_end|>: control tokens stay whole


def test_sentencepiece_token_ids_are_transformers_own(tmp_path):
    tokens, _, _ = sentencepiece_vocabulary()
    path = tmp_path / "spm.gguf"
    write_gguf(path, "llama", hugging_face_tensors(len(tokens), True, False, seed=5), {}, sentencepiece_tokenizer)
    model = read_gguf(path)
    assert_same_ids(path, model)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(model.tokenizer_json).encode("x ж€").ids  # letters the training text never had
    assert ids[0] == 1 and ids[-5:] == [3 + byte for byte in "ж€".encode()]  # BOS; <0xD0><0xB6><0xE2><0x82><0xAC>


def test_added_tokens_stay_whole_and_no_id_lies_past_the_vocabulary(tmp_path):
    """A user-defined token (`<think>`) is matched whole, as transformers does. Where transformers would hand out ids
    the model has no row for (a BOS spelled outside the byte alphabet, GPT-2's default `<|endoftext|>` when the
    vocabulary lacks one), the tokenizer keeps the file's own ids instead."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    base, merges = byte_level_vocabulary()
    tokens = [token if token != "<|endoftext|>" else "<|end_of_text|>" for token in base]
    extras = [("<\uff5cbegin\u2581of\u2581sentence\uff5c>", 3), ("<think>", 4), ("</think>", 4)]
    bos = len(tokens)
    tokens += [token for token, _ in extras]
    token_types = [3] * 3 + [1] * (len(base) - 3) + [kind for _, kind in extras]
    tokenizer = byte_level_tokenizer("qwen2", tokens, merges, token_types, bos=bos, pad=70, add_bos=True)  # 70: a plain token
    path = tmp_path / "added.gguf"
    write_gguf(path, "qwen2", hugging_face_tensors(len(tokens), True, True, seed=4), {}, tokenizer)
    ours = Tokenizer.from_str(read_gguf(path).tokenizer_json)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "<think>def f_1(x):</think> <|im_start|> g"
    plain = ours.encode(text, add_special_tokens=False).ids
    assert plain == reference(text, add_special_tokens=False)["input_ids"]
    assert plain[0] == tokens.index("<think>") and tokens.index("</think>") in plain and 1 in plain
    assert ours.encode(text).ids == [bos, *plain]
    assert reference(text)["input_ids"] == [len(tokens) + 1, *plain]  # transformers' BOS: past the vocabulary
    assert reference("<|endoftext|>", add_special_tokens=False)["input_ids"] == [len(tokens)]
    pieces = ours.encode("<|endoftext|>", add_special_tokens=False).ids
    assert max(pieces) < len(tokens) and ours.decode(pieces, skip_special_tokens=False) == "<|endoftext|>"
    assert ours.get_vocab_size() == len(tokens)


def test_per_layer_and_sliding_window_metadata(tmp_path):
    from modcli.pretrained.adapters import ADAPTERS

    tokens, _ = byte_level_vocabulary()
    tensors = hugging_face_tensors(len(tokens), True, False, seed=6)
    path = tmp_path / "mistral.gguf"
    write_gguf(path, "llama", tensors, {}, head_count_kv=[KV_HEADS] * LAYERS, sliding_window=32)
    model = read_gguf(path)
    assert model.config["num_key_value_heads"] == KV_HEADS and model.config["architectures"] == ["MistralForCausalLM"]
    assert ADAPTERS["MistralForCausalLM"].model_config(model.config, 32, model.tensor_names).seq_len == 32
    with pytest.raises(UserError, match="sliding-window attention \\(window 32\\) is not supported"):
        ADAPTERS["MistralForCausalLM"].model_config(model.config, 64, model.tensor_names)
    write_gguf(path, "llama", tensors, {}, head_count_kv=[2, 4])
    with pytest.raises(UserError, match=r"llama.attention.head_count_kv differs between layers \(\[2, 4\]\)"):
        read_gguf(path)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    """Llama 3.1/3.2 GGUFs carry rope_freqs.weight (llama.cpp's formula, written out here) instead of metadata."""
    import math

    from modcli.pretrained.adapters import ADAPTERS

    def rope_freqs(factor: float) -> np.ndarray:  # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
        base, low, high, old_context = 50000.0, 1.0, 4.0, 8192
        freqs = 1.0 / (base ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
        factors = []
        for freq in freqs:
            wavelength = 2 * math.pi / freq
            if wavelength < old_context / high:
                factors.append(1)
            elif wavelength > old_context / low:
                factors.append(factor)
            else:
                smooth = (old_context / wavelength - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return np.array(factors, dtype=np.float32)

    tokens, _ = byte_level_vocabulary()
    tensors = hugging_face_tensors(len(tokens), True, False, seed=1)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", tensors, {}, extra_tensors=[("rope_freqs.weight", rope_freqs(32.0))])
    model = read_gguf(path)
    assert model.config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in model.tensor_names
    assert ADAPTERS["LlamaForCausalLM"].model_config(model.config, None, model.tensor_names).rope_scaling[
        "factor"] == 32.0

    bogus = rope_freqs(8.0)
    bogus[3] *= 1.5
    write_gguf(path, "llama", tensors, {}, extra_tensors=[("rope_freqs.weight", bogus)])
    with pytest.raises(UserError, match="rope_freqs.weight is not Llama 3's RoPE scaling"):
        read_gguf(path)

    write_gguf(path, "llama", tensors, {}, rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=4.0)
    model = read_gguf(path)
    assert model.config["rope_scaling"]["rope_type"] == "linear"
    with pytest.raises(UserError, match="rope_scaling 'linear' is not supported"):
        ADAPTERS["LlamaForCausalLM"].model_config(model.config, None, model.tensor_names)


def test_bad_files_are_one_user_error_each(tmp_path, monkeypatch):
    tokens, _ = byte_level_vocabulary()
    tensors = hugging_face_tensors(len(tokens), True, False, seed=2)
    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", tensors, {})
    cases = []

    def case(label: str, message: str) -> Path:
        path = tmp_path / f"{label}.gguf"
        cases.append((path, message))
        return path

    write_gguf(case("gpt2", "GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"), "gpt2",
               tensors, {})
    case("text", "not a readable GGUF file").write_text("this is not a GGUF file\n" * 10)
    case("truncated", "not a readable GGUF file").write_bytes(good.read_bytes()[:5000])
    write_gguf(case("f64", f"stored as F64, which modcli cannot dequantize; supported: {', '.join(TENSOR_TYPES)}"),
               "llama", tensors, {}, extra_tensors=[("output.weight", np.ones((len(tokens), D_MODEL), np.float64))])
    write_gguf(case("qknorm", "tensor blk.0.attn_q_norm.weight is not part of the llama layout"), "llama",
               tensors, {}, extra_tensors=[("blk.0.attn_q_norm.weight", np.ones(HEAD_DIM, np.float32))])
    write_gguf(case("bert", "tokenizer 'bert' is not supported; supported: gpt2 (byte-level BPE), llama"), "llama",
               tensors, {}, byte_level_tokenizer(model="bert"))
    write_gguf(case("partial", "RoPE on 8 of each head's 16 dimensions (partial rotary) is not supported"), "llama",
               tensors, {}, rope_dimension_count=8)
    case("missing", "no such GGUF file")
    for path, message in cases:
        with pytest.raises(UserError) as error:
            read_gguf(path)
        assert message in str(error.value) and "\n" not in str(error.value), (path.name, str(error.value))

    model = read_gguf(good)
    with pytest.raises(UserError, match="tensor lm_head.weight is missing from the file"):
        model.tensor("lm_head.weight")
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(UserError, match=r'needs the gguf package: pip install "modcli\[gguf\]"'):
        read_gguf(good)


def test_modcli_import_reads_a_gguf_file(gguf_model, tmp_path):
    """`modcli import FILE.gguf`: the run holds transformers' model and tokenizer; a bad file exits 2, one line."""
    from typer.testing import CliRunner

    from modcli.checkpoint.store import load_model_from
    from modcli.cli import app

    name, path, _, _ = gguf_model
    _, reference, _ = transformers_load(path)
    result = CliRunner().invoke(app, ["import", str(path), "--out", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["architecture"] == read_gguf(path).config["architectures"][0]
    model, _, _ = load_model_from(tmp_path / "run")
    tokens = torch.randint(0, reference.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=1e-4, rtol=0)
    assert (tmp_path / "run" / "tokenizer.json").read_text(encoding="utf-8") == read_gguf(path).tokenizer_json
    (tmp_path / "bad.gguf").write_text("not a GGUF file")
    result = CliRunner().invoke(app, ["import", str(tmp_path / "bad.gguf"), "--out", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "not a readable GGUF file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


def test_malformed_models_are_one_line_exit_2_and_write_nothing(tmp_path):
    """`modcli import FILE.gguf` of metadata of the wrong type or range, heads that do not divide the width, and
    tensors whose shapes disagree with the metadata: one line naming the key or tensor, exit 2, no run folder
    (these were RuntimeError, ValueError and TypeError tracebacks)."""
    from typer.testing import CliRunner

    from modcli.cli import app

    tokens, _ = byte_level_vocabulary()
    tensors = hugging_face_tensors(len(tokens), True, False, seed=3)
    cases = []

    def case(label: str, message: str, model: dict | None = None, architecture: str = "llama", **metadata) -> None:
        path = tmp_path / f"{label}.gguf"
        write_gguf(path, architecture, model or tensors, {}, **metadata)
        cases.append((path, message))

    case("heads", "metadata llama.attention.head_count (6) does not divide llama.embedding_length (64)",
         head_count=6, head_count_kv=6, rope_dimension_count=None)
    case("kvheads", "metadata llama.attention.head_count_kv (3) does not divide llama.attention.head_count (4)",
         head_count_kv=3)
    case("blocks", "metadata llama.block_count must be a positive integer, got 'two'", block_count=None,
         raw_metadata={"llama.block_count": "two"})
    case("noblocks", "metadata llama.block_count is missing", block_count=None)
    case("zero", "metadata llama.feed_forward_length must be a positive integer, got 0", feed_forward_length=0)
    case("width", "metadata llama.embedding_length must be a positive integer, got 64.0", embedding_length=None,
         raw_metadata={"llama.embedding_length": 64.0})
    case("eps", "metadata llama.attention.layer_norm_rms_epsilon must be a positive number, got 'tiny'",
         layer_norm_rms_eps=None, raw_metadata={"llama.attention.layer_norm_rms_epsilon": "tiny"})
    case("ffn", "tensor model.layers.0.mlp.gate_proj.weight has shape (256, 64), but the config makes it (128, 64) "
         "(llama.feed_forward_length, llama.embedding_length)", feed_forward_length=128)
    narrow_k = dict(tensors, **{"model.layers.1.self_attn.k_proj.weight": np.zeros((16, D_MODEL), np.float32)})
    case("kshape", "tensor model.layers.1.self_attn.k_proj.weight has shape (16, 64), but the config makes it "
         "(32, 64)", model=narrow_k)
    case("layers", "the weights hold layers 0..1, but llama.block_count is 1", block_count=1)
    qwen3 = hugging_face_tensors(len(tokens), True, False, seed=3, qk_norm=True)
    case("nonorm", "tensor model.layers.1.self_attn.k_norm.weight is missing from the file", architecture="qwen3",
         model={name: values for name, values in qwen3.items() if name != "model.layers.1.self_attn.k_norm.weight"})
    case("wideqnorm", "tensor model.layers.0.self_attn.q_norm.weight has shape (32,), but the config makes it (16,) "
         "(qwen3.attention.key_length)", architecture="qwen3",
         model=dict(qwen3, **{"model.layers.0.self_attn.q_norm.weight": np.ones(32, np.float32)}))
    for path, message in cases:
        out = tmp_path / f"out-{path.stem}"
        result = CliRunner().invoke(app, ["import", str(path), "--out", str(out)])
        assert result.exit_code == 2, (path.name, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (path.name, result.stderr)
        assert "Traceback" not in result.output and not out.exists(), path.name
