"""`modcli import`: tiny random Llama, Mistral, Qwen2 and Qwen3 models made offline with `transformers` (a test-only
dependency) give the same logits and greedy tokens in modcli; bad folders exit 2 with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from modcli.cli import app
from tests.conftest import make_corpus_text

transformers = pytest.importorskip("transformers")

ARCHITECTURES = {
    # GQA, untied head, Llama-3 RoPE scaling, an explicit head_dim that is not d_model / heads
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=24, rope_theta=50000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    # GQA, q/k/v biases, tied embeddings
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # GQA, no sliding window in use
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # GQA, q/k norms (random weights), tied embeddings, a head_dim that is not d_model / heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=True)),
}
ATOL = 1e-4
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
"""The split before byte-level BPE in Qwen's tokenizer.json, which transformers' Qwen2Tokenizer (what AutoTokenizer
picks for a qwen3 folder without a tokenizer_config.json) applies whatever the file says."""


def make_tokenizer(folder: Path, split: str | None = None) -> None:
    """A byte-level BPE of ~300 tokens at `folder`/tokenizer.json; `split`: a regex split before the bytes (GPT-2's
    when None)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([make_corpus_text(100)], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))


def save_tiny_hf_model(name: str, folder: Path):
    """A tiny random transformers model of ARCHITECTURES[name] saved with a tokenizer at `folder`; returns it (float32,
    eval mode)."""
    config_name, model_name, extra = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, **extra)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # transformers starts norm weights at 1; a q/k norm at 1 would hide a weight mix-up
        for parameter, weight in model.named_parameters():
            if parameter.endswith(("q_norm.weight", "k_norm.weight")):
                weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    make_tokenizer(folder, QWEN_SPLIT if name == "qwen3" else None)
    return model


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def hf_model(request, tmp_path_factory):
    """(architecture name, folder, the transformers model in float32 eval mode)."""
    folder = tmp_path_factory.mktemp("hf") / request.param
    model = save_tiny_hf_model(request.param, folder)
    return request.param, folder, model


def import_run(folder: Path, out: Path, *extra: str):
    return CliRunner().invoke(app, ["import", str(folder), "--out", str(out), *extra])


def test_imported_model_has_the_same_logits_and_greedy_tokens(hf_model, tmp_path):
    from modcli.checkpoint.store import load_model_from
    from modcli.decode.generation import GenerateConfig, generate

    name, folder, reference = hf_model
    result = import_run(folder, tmp_path / "run", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["architecture"] == reference.config.architectures[0] and summary["vocab_size"] == 320
    model, run_config, _ = load_model_from(tmp_path / "run")
    assert run_config.model.kv_heads == 2 and run_config.model.dense
    assert model.num_parameters() == sum(p.numel() for p in reference.parameters())

    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=ATOL, rtol=0)

    prompt = "def f_3(x):\n    return"
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(prompt).ids
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                  pad_token_id=0)[0, len(ids):].tolist()
    got = generate(GenerateConfig(checkpoint=str(tmp_path / "run"), prompts=[prompt], max_new_tokens=12,
                                  temperature=0, device="cpu"))
    assert got.tokens == [want]


@pytest.mark.slow
def test_the_imported_run_works_with_generate_and_profile(hf_model, tmp_path):
    name, folder, _ = hf_model
    assert import_run(folder, tmp_path / "run").exit_code == 0
    runner = CliRunner()
    result = runner.invoke(app, ["generate", str(tmp_path / "run"), "--prompt", "def f", "--max-new-tokens", "5",
                                 "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("def f")
    result = runner.invoke(app, ["profile", str(tmp_path / "run"), "--compare", "none", "--seq-len", "16",
                                 "--batch-size", "1", "--repeats", "1", "--warmup", "0", "--no-memory",
                                 "--measure", "forward,decode", "--decode-tokens", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus_text(1500))
    result = runner.invoke(app, ["eval", str(tmp_path / "run"), "--data", str(corpus), "--batches", "2",
                                 "--batch-size", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert "tokenized with tokenizer.json" in report["corpus"] and report["results"][0]["routing"] == "dense"


def test_bad_model_folders_exit_2_with_one_line_and_write_nothing(hf_model, tmp_path):
    name, folder, _ = hf_model
    if name != "qwen2":
        pytest.skip("one architecture is enough for the folder checks")
    cases = []

    def case(label: str, edit, message: str) -> None:
        broken = tmp_path / label
        shutil.copytree(folder, broken)
        edit(broken)
        cases.append((broken, message))

    def set_config(key, value):
        def edit(broken: Path) -> None:
            config = json.loads((broken / "config.json").read_text())
            config[key] = value
            (broken / "config.json").write_text(json.dumps(config))
        return edit

    def drop_config(key):
        def edit(broken: Path) -> None:
            config = json.loads((broken / "config.json").read_text())
            del config[key]
            (broken / "config.json").write_text(json.dumps(config))
        return edit

    def replace_tensor(name, shape):
        def edit(broken: Path) -> None:
            tensors = load_file(broken / "model.safetensors")
            tensors[name] = torch.zeros(shape)
            save_file(tensors, broken / "model.safetensors")
        return edit

    def add_tokens(count):
        def edit(broken: Path) -> None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(broken / "tokenizer.json"))
            tokenizer.add_tokens([f"<extra_{i}>" for i in range(count)])
            tokenizer.save(str(broken / "tokenizer.json"))
        return edit

    def drop_tensor(broken: Path) -> None:
        tensors = load_file(broken / "model.safetensors")
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, broken / "model.safetensors")

    def pickle_only(broken: Path) -> None:
        (broken / "model.safetensors").rename(broken / "pytorch_model.bin")

    case("gpt2", set_config("architectures", ["GPT2LMHeadModel"]),
         "architecture GPT2LMHeadModel is not supported; supported: LlamaForCausalLM, MistralForCausalLM, "
         "Qwen2ForCausalLM, Qwen3ForCausalLM")
    case("missing", drop_tensor, "tensor model.layers.1.mlp.up_proj.weight is missing from model.safetensors")
    case("pickle", pickle_only, "only pickle weights (pytorch_model.bin)")
    case("window", lambda b: (set_config("use_sliding_window", True)(b), set_config("sliding_window", 8)(b)),
         "sliding-window attention (window 8) is not supported")
    case("shape", set_config("intermediate_size", 80), "tensor model.layers.0.mlp.gate_proj.weight has shape "
         "(96, 64), but the config makes it (80, 64) (intermediate_size, hidden_size)")
    case("notok", lambda b: (b / "tokenizer.json").unlink(), "no tokenizer.json")
    # malformed configs: each field named, nothing built (these were AttributeError, KeyError, TypeError tracebacks)
    case("list", lambda b: (b / "config.json").write_text("[1, 2]"), "config.json: must hold a JSON object")
    case("nowidth", drop_config("hidden_size"), "config.json: hidden_size is missing")
    case("wordwidth", set_config("hidden_size", "sixty-four"),
         "config.json: hidden_size must be an integer >= 1, got 'sixty-four'")
    case("nulllayers", set_config("num_hidden_layers", None),
         "config.json: num_hidden_layers must be an integer >= 1, got None")
    case("zeroheads", set_config("num_attention_heads", 0), "num_attention_heads must be an integer >= 1, got 0")
    case("truelayers", set_config("num_hidden_layers", True), "num_hidden_layers must be an integer >= 1, got True")
    case("heads", set_config("num_attention_heads", 6),
         "num_attention_heads (6) does not divide hidden_size (64) and no head_dim gives the head size")
    case("kvheads", set_config("num_key_value_heads", 3), "num_key_value_heads (3) does not divide "
         "num_attention_heads (4)")
    case("eps", set_config("rms_norm_eps", "small"), "rms_norm_eps must be a positive number, got 'small'")
    case("scaling", set_config("rope_scaling", {"rope_type": "llama3"}),
         "rope_scaling's factor must be a positive number, got None")
    case("architectures", set_config("architectures", "Qwen2ForCausalLM"), "architectures must be a list of names")
    # weights that disagree with the config (torch.cat's "Sizes of tensors must match" before)
    case("kshape", replace_tensor("model.layers.1.self_attn.k_proj.weight", (32, 48)),
         "tensor model.layers.1.self_attn.k_proj.weight has shape (32, 48), but the config makes it (32, 64) "
         "(num_key_value_heads x head_dim, hidden_size)")
    case("layers", set_config("num_hidden_layers", 2), "the weights hold layers 0..2, but num_hidden_layers is 2")
    case("manylayers", set_config("num_hidden_layers", 10**9), "the weights hold layers 0..2, but num_hidden_layers "
         "is 1000000000")
    # a tokenizer with ids past the model's vocabulary (an IndexError in generate and eval before)
    case("bigtok", add_tokens(40), "the tokenizer has 340 tokens but the model's vocabulary has 320")
    case("badtok", lambda b: (b / "tokenizer.json").write_text("{}"), "not a readable tokenizer.json")
    assert_imports_refused(cases, tmp_path)
    result = import_run(tmp_path / "nowhere", tmp_path / "out")
    assert result.exit_code == 2 and "no such model folder" in result.stderr
    assert import_run(folder, tmp_path / "twice").exit_code == 0
    result = import_run(folder, tmp_path / "twice")
    assert result.exit_code == 2 and "already holds checkpoints" in result.stderr


def assert_imports_refused(cases: list[tuple[Path, str]], tmp_path: Path) -> None:
    """Each (folder, message): `modcli import` says the message in one line, exits 2 and writes nothing."""
    for broken, message in cases:
        out = tmp_path / f"out-{broken.name}"
        result = import_run(broken, out)
        assert result.exit_code == 2, (broken.name, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not out.exists()


def test_bad_qwen3_folders_name_the_q_k_norm_and_exit_2(hf_model, tmp_path):
    """A Qwen3 folder without a q/k norm, with one of another width, or with attention_bias (which also puts a bias
    on the output projection): one line naming it, exit 2, nothing written."""
    name, folder, _ = hf_model
    if name != "qwen3":
        pytest.skip("the q/k norms are Qwen3's")

    def edited(label: str, change) -> Path:
        broken = tmp_path / label
        shutil.copytree(folder, broken)
        tensors = load_file(broken / "model.safetensors")
        change(tensors)
        save_file(tensors, broken / "model.safetensors")
        return broken

    cases = [
        (edited("nonorm", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight")),
         "tensor model.layers.1.self_attn.k_norm.weight is missing from model.safetensors"),
        (edited("narrow", lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(16))),
         "tensor model.layers.0.self_attn.q_norm.weight has shape (16,), but the config makes it (24,) (head_dim)"),
        (edited("obias", lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias", torch.zeros(64))),
         "a bias on the attention output projection (attention_bias) is not supported"),
    ]
    assert_imports_refused(cases, tmp_path)


@pytest.mark.slow
def test_router_tuning_converts_a_frozen_imported_model(hf_model, tmp_path):
    """`--init-from` an imported dense model with a threshold router, training only the routers: the base weights do
    not move, every command works on the result, and the summary shows the original's loss beside."""
    from modcli.checkpoint.store import resolve_checkpoint

    name, folder, _ = hf_model
    if name not in ("qwen2", "qwen3"):
        pytest.skip("Qwen2 (q/k/v biases) and Qwen3 (q/k norms) are enough for the conversion")
    assert import_run(folder, tmp_path / "dense").exit_code == 0
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus_text(1500))
    runner = CliRunner()
    common = ["train", "--init-from", str(tmp_path / "dense"), "--data", str(corpus), "--seq-len", "64",
              "--batch-size", "2", "--max-steps", "6", "--eval-every", "3", "--eval-batches", "1", "--warmup", "1",
              "--device", "cpu"]
    result = runner.invoke(app, [*common, "--router", "threshold", "--capacity", "0.5", "--trainable", "routers",
                                 "--out", str(tmp_path / "mod"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["router"] == "threshold" and summary["init_val_loss"] > 0
    before = load_file(resolve_checkpoint(tmp_path / "dense") / "model.safetensors")
    after = load_file(resolve_checkpoint(tmp_path / "mod") / "model.safetensors")
    routers = [key for key in after if ".router." in key]
    assert routers and all(key not in before for key in routers)
    for key, tensor in before.items():  # frozen: bit for bit the imported weights
        assert torch.equal(after[key], tensor), key
    assert (tmp_path / "mod" / "tokenizer.json").is_file()

    for args in (["eval", str(tmp_path / "mod"), "--data", str(corpus), "--batches", "1", "--batch-size", "2"],
                 ["generate", str(tmp_path / "mod"), "--prompt", "def f", "--max-new-tokens", "4"],
                 ["profile", str(tmp_path / "mod"), "--compare", str(tmp_path / "dense"), "--seq-len", "16",
                  "--batch-size", "1", "--repeats", "1", "--warmup", "0", "--no-memory", "--decode-tokens", "2"]):
        result = runner.invoke(app, [*args, "--device", "cpu"])
        assert result.exit_code == 0, (args[0], result.output)

    result = runner.invoke(app, [*common, "--d-model", "32", "--out", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "--init-from: --d-model is 32 but" in result.stderr
    assert not (tmp_path / "bad").exists()
    result = runner.invoke(app, [*common, "--trainable", "everything", "--out", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "--trainable must be one of all, routers, routers+norms" in result.stderr
    assert_the_bundle_generates_what_modcli_does(tmp_path / "mod", tmp_path / "bundle")


def assert_the_bundle_generates_what_modcli_does(run: Path, bundle: Path) -> None:
    """`modcli export` of `run` validates against eager PyTorch, carries the tokenizer, and the PyTorch-free runtime
    (what `modcli-run` runs) generates what `modcli generate` does, greedily."""
    from modcli_runtime import load_bundle

    from modcli.bundle.writer import ExportConfig, export
    from modcli.decode.generation import GenerateConfig, generate

    exported = export(ExportConfig(checkpoint=str(run), out=str(bundle), provider="cpu", decode_steps=4))
    assert exported.valid, exported.failures
    assert (bundle / "tokenizer.json").is_file()
    want = generate(GenerateConfig(checkpoint=str(run), prompts=["def f_1(x):"], max_new_tokens=8, temperature=0,
                                   device="cpu"))
    got = load_bundle(bundle).generate(["def f_1(x):"], max_new_tokens=8, temperature=0)
    assert got.tokens == want.tokens and got.texts == want.texts


@pytest.mark.slow
def test_a_static_drop_of_an_imported_model_exports_and_runs(hf_model, tmp_path):
    """`train --init-from RUN --dense --drop attention:1 --max-steps 0` of an imported Qwen3: the blocks that keep
    their attention keep their q/k norms, the model is the import with that attention removed, and its ONNX bundle
    and the runtime work as for any run."""
    import dataclasses

    from modcli.checkpoint.store import load_model_from
    from modcli.models.decoder import MoDDecoder

    name, folder, _ = hf_model
    if name != "qwen3":
        pytest.skip("Qwen3 (q/k norms) is the layout the other drop tests do not cover")
    assert import_run(folder, tmp_path / "dense").exit_code == 0
    result = CliRunner().invoke(app, ["train", "--init-from", str(tmp_path / "dense"), "--dense", "--drop",
                                      "attention:1", "--max-steps", "0", "--out", str(tmp_path / "dropped")])
    assert result.exit_code == 0, result.output
    model, run_config, _ = load_model_from(tmp_path / "dropped")
    assert run_config.model.qk_norm and run_config.model.drop == "attention:1" and run_config.model.dense
    assert model.blocks[1].attn is None and model.blocks[0].attn.q_norm is not None
    original = load_model_from(tmp_path / "dense")[0]
    expected = MoDDecoder(dataclasses.replace(original.config, drop="attention:1")).eval()
    expected.load_state_dict(original.state_dict(), strict=False)
    tokens = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected(tokens), atol=1e-6, rtol=0)
    assert_the_bundle_generates_what_modcli_does(tmp_path / "dropped", tmp_path / "bundle")


def test_a_conversion_starts_as_the_model_it_came_from(hf_model, tmp_path):
    """Step-0 identity: `--init-from` an imported model defaults to the unit router weight (value 1, the sigmoid's
    gradient), so at capacity 1.0 (every token processed) the converted model evaluates as the dense one; the
    sigmoid weight, ~0.5 for fresh routers, halves every update and does not."""
    name, folder, _ = hf_model
    if name != "llama":
        pytest.skip("one architecture is enough for the conversion")
    assert import_run(folder, tmp_path / "dense").exit_code == 0
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus_text(1500))
    runner = CliRunner()
    common = ["train", "--init-from", str(tmp_path / "dense"), "--data", str(corpus),  # the import's context length
              "--batch-size", "2", "--max-steps", "1", "--lr", "1e-12", "--eval-every", "1", "--eval-batches", "1",
              "--router", "topk", "--capacity", "1.0", "--route-every", "1", "--route-offset", "0",
              "--trainable", "routers", "--device", "cpu", "--json"]
    losses = {}
    for weight in (None, "sigmoid"):
        out = tmp_path / f"mod-{weight}"
        result = runner.invoke(app, [*common, "--out", str(out), *(["--router-weight", weight] if weight else [])])
        assert result.exit_code == 0, result.output
        saved = json.loads((out / "step-00000001" / "config.json").read_text())
        assert saved["model"]["router_weight"] == (weight or "unit")
        evaluated = runner.invoke(app, ["eval", str(out), "--data", str(corpus), "--routing", "topk", "--batches",
                                        "2", "--batch-size", "2", "--device", "cpu", "--json"])
        assert evaluated.exit_code == 0, evaluated.output
        losses[weight] = json.loads(evaluated.stdout)["results"][0]["loss"]
    dense = runner.invoke(app, ["eval", str(tmp_path / "dense"), "--data", str(corpus), "--batches", "2",
                                "--batch-size", "2", "--device", "cpu", "--json"])
    assert dense.exit_code == 0, dense.output
    dense_loss = json.loads(dense.stdout)["results"][0]["loss"]
    assert losses[None] == pytest.approx(dense_loss, rel=1e-3)  # within 0.1% (the goal)
    assert abs(losses["sigmoid"] - dense_loss) > 1e-2  # the old default does not start where the model is


def test_the_unit_router_weight_is_one_with_the_sigmoid_gradient():
    from modcli.models.routing.base import unit_weight

    logits = torch.randn(3, 7, requires_grad=True)
    weight = unit_weight(logits)
    assert torch.equal(weight, torch.ones_like(weight))
    weight.sum().backward()
    torch.testing.assert_close(logits.grad, torch.sigmoid(logits) * (1 - torch.sigmoid(logits)))
