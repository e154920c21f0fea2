"""`modcli export --gguf`: tiny imported Llama / Mistral / Qwen2 / Qwen3 runs become GGUF files whose logits in
transformers' GGUF loader equal modcli's and the original transformers model's; an attention drop becomes `deci`
(per-layer head counts) and equals modcli through the reference of llama.cpp's graph; `modcli import` of the file
gives the run back; half-precision storage; a wrong file is caught and not written; every refusal is one line, exit
code 2, and leaves nothing behind."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from modcli.bundle import gguf_export
from modcli.bundle.config import ExportConfig
from modcli.bundle.gguf_export import GGUFFile, export_gguf
from modcli.checkpoint.store import load_model_from, save_checkpoint
from modcli.cli import app
from modcli.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from modcli.models.decoder import MoDDecoder
from tests.conftest import make_corpus_text

pytest.importorskip("gguf")

ATOL = 1e-4
GGUF_ARCHITECTURE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""The tiny transformers models of tests/pretrained (ARCHITECTURES there) -> the GGUF architecture they export as."""


def tiny_imported(name: str, root: Path):
    """A tiny random transformers model of tests/pretrained's ARCHITECTURES[name] (saved at root/original) and its
    `modcli import` at root/run; skipped where transformers is not installed."""
    pytest.importorskip("transformers")
    from tests.pretrained.test_pretrained import save_tiny_hf_model

    reference = save_tiny_hf_model(name, root / "original")
    result = CliRunner().invoke(app, ["import", str(root / "original"), "--out", str(root / "run")])
    assert result.exit_code == 0, result.output
    return reference, root / "run"


@pytest.fixture(scope="module", params=list(GGUF_ARCHITECTURE))
def imported(request, tmp_path_factory):
    """(name, the original transformers model, the imported modcli run)."""
    reference, run = tiny_imported(request.param, tmp_path_factory.mktemp(f"gguf-{request.param}"))
    return request.param, reference, run


def export(run: Path, out: Path, **options):
    return export_gguf(ExportConfig(checkpoint=str(run), out=str(out), gguf=True, **options))


def tokens_of(seed: int, vocab: int = 320) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(seed))


def transformers_load(path: Path, original) -> torch.nn.Module:
    """The file through transformers' GGUF loader, with the two fields it does not read from GGUF (Qwen3's head_dim,
    Llama 3 RoPE scaling) taken from the original model's config."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if getattr(original.config, "head_dim", None):
        config.head_dim = original.config.head_dim
    if getattr(original.config, "rope_parameters", None):
        config.rope_parameters = dict(original.config.rope_parameters)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                             dtype=torch.float32).eval()


@torch.no_grad()
def test_a_dense_imported_model_loads_in_transformers_with_the_same_logits(imported, tmp_path):
    name, reference, run = imported
    result = export(run, tmp_path / "model.gguf")
    assert result.valid and result.architecture == GGUF_ARCHITECTURE[name], result
    assert {c.runner.split()[0] for c in result.checks} == {"gguf", "llama.cpp", "transformers"}
    assert all(c.passed for c in result.checks) and max(c.max_abs_diff or 0 for c in result.checks) < 1e-5
    hf = transformers_load(tmp_path / "model.gguf", reference)
    model, _, _ = load_model_from(run)
    for seed in (1, 2):
        torch.testing.assert_close(hf(tokens_of(seed)).logits, model(tokens_of(seed)), atol=ATOL, rtol=0)
        torch.testing.assert_close(hf(tokens_of(seed)).logits, reference(tokens_of(seed)).logits, atol=ATOL, rtol=0)
    file = GGUFFile(tmp_path / "model.gguf")
    assert file.arch("context_length") == 128 and file.arch("block_count") == 3  # the original's context
    assert file.get("tokenizer.ggml.model") == "gpt2" and len(file.get("tokenizer.ggml.tokens")) == 320
    assert ("rope_freqs.weight" in {t.name for t in file.reader.tensors}) == (name == "llama")
    assert not list(tmp_path.glob(".*"))  # no temporary file, no lock left


@torch.no_grad()
@pytest.mark.parametrize("name", ["mistral", "qwen3"])  # llama's q/k rows interleaved; qwen3's head_dim in key_length
def test_modcli_import_of_the_file_gives_the_run_back(name, tmp_path):
    reference, _ = tiny_imported(name, tmp_path)
    export(tmp_path / "run", tmp_path / "model.gguf")
    result = CliRunner().invoke(app, ["import", str(tmp_path / "model.gguf"), "--out", str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    (model, _, _), (back, _, _) = load_model_from(tmp_path / "run"), load_model_from(tmp_path / "back")
    torch.testing.assert_close(back(tokens_of(3)), model(tokens_of(3)), atol=1e-5, rtol=0)
    torch.testing.assert_close(back(tokens_of(3)), reference(tokens_of(3)).logits, atol=ATOL, rtol=0)
    from tokenizers import Tokenizer

    text = make_corpus_text(3)
    ids = [Tokenizer.from_file(str(tmp_path / run / "tokenizer.json")).encode(text).ids for run in ("run", "back")]
    assert ids[0] == ids[1]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_files_store_matrices_in_half_and_norms_in_float32(dtype, tmp_path):
    tiny_imported("qwen2", tmp_path)
    result = export(tmp_path / "run", tmp_path / "model.gguf", gguf_dtype=dtype)
    assert result.valid and all(c.passed for c in result.checks)
    assert result.float32_diff is not None and 0 < result.float32_diff < 0.1  # what the rounding costs
    kinds = {t.name: t.tensor_type.name for t in GGUFFile(tmp_path / "model.gguf").reader.tensors}
    half = {"float16": "F16", "bfloat16": "BF16"}[dtype]
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == half
    assert kinds["blk.0.attn_norm.weight"] == kinds["output_norm.weight"] == kinds["blk.0.attn_q.bias"] == "F32"


def converted_run(run: Path, root: Path, **changes) -> tuple[Path, MoDDecoder]:
    """The imported run's weights under a changed config (a static drop: the dropped weights left out)."""
    dense, run_config, _ = load_model_from(run)
    config = dataclasses.replace(run_config.model, **changes)
    torch.manual_seed(0)
    model = MoDDecoder(config).eval()
    model.load_state_dict(dense.state_dict(), strict=False)
    saved = RunConfig(model=config, data=DataConfig(tokenizer=str((run / "tokenizer.json").resolve())),
                      train=TrainConfig(out=str(root)))
    save_checkpoint(root, 1, model, None, saved, {"step": 1}, keep=1)
    return root, model


@torch.no_grad()
def test_an_attention_drop_exports_as_deci_with_per_layer_head_counts(tmp_path):
    tiny_imported("llama", tmp_path)  # GQA, head_dim 24, Llama 3 RoPE scaling
    run, model = converted_run(tmp_path / "run", tmp_path / "cut", drop="attention:1")
    result = export(run, tmp_path / "cut.gguf")
    assert result.valid and result.architecture == "deci" and all(c.passed for c in result.checks)
    assert any("deci" in note for note in result.notes)  # transformers has no deci class: the reference checks it
    file = GGUFFile(tmp_path / "cut.gguf")
    assert file.arch("attention.head_count") == [4, 0, 4] and file.arch("attention.head_count_kv") == [2, 0, 2]
    assert file.arch("feed_forward_length") == [96, 96, 96] and file.arch("attention.key_length") == 24
    names = {t.name for t in file.reader.tensors}
    assert not any(n.startswith("blk.1.attn") for n in names) and "blk.1.ffn_up.weight" in names
    torch.testing.assert_close(file.reference_logits(tokens_of(5)).float(), model(tokens_of(5)), atol=ATOL, rtol=0)


def test_a_wrong_file_is_caught_and_nothing_is_written(imported, tmp_path, monkeypatch):
    """q/k rows left in Hugging Face's order in a llama file: llama.cpp would rotate the wrong pairs; the check fails
    (exit 1) and --out stays absent."""
    name, _, run = imported
    if name not in ("llama", "mistral"):
        pytest.skip("only llama files interleave the q/k rows")
    monkeypatch.setattr(gguf_export, "_interleave_rotary", lambda values, heads: values)
    result = CliRunner().invoke(app, ["export", str(run), "--gguf", "--out", str(tmp_path / "bad.gguf")])
    assert result.exit_code == 1 and "differs from modcli, nothing written" in result.stderr, result.output
    assert list(tmp_path.iterdir()) == []


def bpe_tokenizer(path: Path) -> Path:
    """A byte-level BPE of ~300 tokens (what `modcli tokenizer train` writes), with one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([make_corpus_text(50)], trainer)
    tokenizer.save(str(path))
    return path


@torch.no_grad()
def test_a_model_trained_in_modcli_exports_as_llama_and_without_transformers_says_so(tmp_path, monkeypatch):
    find_spec = gguf_export.importlib.util.find_spec
    monkeypatch.setattr(gguf_export.importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformers" else find_spec(name, *args))
    tokenizer = bpe_tokenizer(tmp_path / "tokenizer.json")
    run = scratch_run(tmp_path / "run", str(tokenizer), route_every=0, vocab_size=304, n_kv_heads=2)
    result = export(run, tmp_path / "m.gguf")
    assert result.valid and result.architecture == "llama" and any("not installed" in n for n in result.notes)
    assert [c.runner for c in result.checks] == ["gguf reader"] + 2 * ["llama.cpp reference (torch)"]
    file = GGUFFile(tmp_path / "m.gguf")
    tokens = file.get("tokenizer.ggml.tokens")
    assert len(tokens) == 304 and tokens[-1] == "[PAD303]" and file.get("tokenizer.ggml.pre") == "gpt2"
    assert file.get("tokenizer.ggml.token_type")[0] == 3 and file.arch("context_length") == 32  # the special: CONTROL
    model, _, _ = load_model_from(run)
    torch.testing.assert_close(file.reference_logits(tokens_of(5, 304)).float(), model(tokens_of(5, 304)),
                               atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------------ refusals


def invoke(*args: str):
    return CliRunner().invoke(app, ["export", *args])


def one_red_line(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr


def scratch_run(root: Path, tokenizer: str = "bytes", **config) -> Path:
    torch.manual_seed(0)
    model = MoDDecoder(ModelConfig(d_model=32, n_layers=3, n_heads=4, seq_len=32, **config)).eval()
    run = RunConfig(model=model.config, data=DataConfig(tokenizer=tokenizer), train=TrainConfig(out=str(root)))
    save_checkpoint(root, 1, model, None, run, {"step": 1}, keep=1)
    return root


def test_each_refusal_is_one_line_exit_2_and_leaves_nothing(tmp_path):
    runs = tmp_path / "runs"
    out = tmp_path / "out"
    out.mkdir()
    target = str(out / "m.gguf")
    one_red_line(invoke(str(scratch_run(runs / "routed")), "--gguf", "--out", target), "routing has no GGUF form",
                 "--onnx", "--hf")
    one_red_line(invoke(str(scratch_run(runs / "moe", route_every=0, experts=2)), "--gguf", "--out", target),
                 "mixture-of-experts")
    one_red_line(invoke(str(scratch_run(runs / "mlp", route_every=0, drop="mlp:1")), "--gguf", "--out", target),
                 "dropped MLP", "deci")
    one_red_line(invoke(str(scratch_run(runs / "bytes", route_every=0)), "--gguf", "--out", target),
                 "byte tokenizer")
    dense = str(runs / "bytes")
    one_red_line(invoke(dense, "--gguf", "--hf", "--out", target), "--gguf", "--hf")
    one_red_line(invoke(dense, "--gguf", "--gguf-dtype", "int4", "--out", target), "--gguf-dtype", "int4")
    one_red_line(invoke(dense, "--gguf-dtype", "float16", "--out", target), "--gguf-dtype", "needs --gguf")
    one_red_line(invoke(dense, "--gguf", "--out", str(out / "m.bin")), "--out", ".gguf")
    one_red_line(invoke(dense, "--gguf", "--dtype", "float16", "--out", target), "--gguf-dtype")
    assert list(out.iterdir()) == []
    (out / "m.gguf").write_bytes(b"not ours")
    one_red_line(invoke(dense, "--gguf", "--out", target), "already exists", "--force")
    one_red_line(invoke(dense, "--gguf", "--force", "--out", target), "not a GGUF file")
    assert sorted(p.name for p in out.iterdir()) == ["m.gguf"] and (out / "m.gguf").read_bytes() == b"not ours"


def test_a_trait_the_writer_does_not_know_is_refused(tmp_path):
    """A field a newer family added (Gemma 3's sandwich norms), set away from its default: one line, exit 2."""
    if "sandwich_norm" not in {f.name for f in dataclasses.fields(ModelConfig)}:
        pytest.skip("this modcli has no Gemma 3 traits")
    run = scratch_run(tmp_path / "run", route_every=0, sandwich_norm=True)
    one_red_line(invoke(str(run), "--gguf", "--out", str(tmp_path / "m.gguf")), "--gguf", "sandwich")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_force_replaces_an_earlier_file_and_json_reports_it(tmp_path):
    tiny_imported("qwen2", tmp_path)
    target = str(tmp_path / "m.gguf")
    assert invoke(str(tmp_path / "run"), "--gguf", "--out", target).exit_code == 0
    result = invoke(str(tmp_path / "run"), "--gguf", "--force", "--gguf-dtype", "float16", "--out", target, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["valid"] and payload["architecture"] == "qwen2" and payload["dtype"] == "float16"
    assert payload["bytes"] == Path(target).stat().st_size and all(c["passed"] for c in payload["checks"])
    assert np.isfinite(payload["float32_diff"])
