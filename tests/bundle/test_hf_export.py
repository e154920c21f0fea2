"""`modcli export --hf`: the folder loads in transformers (remote code for routed and MoE models, the plain
architecture for dense imported ones) and equals modcli under the causal routing mode: logits, greedy generate()
with the KV cache (batch 1 and a left-padded batch of 2) and the tokens routed blocks process; bad input exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="modcli-hf-modules-"))  # not ~/.cache
transformers = pytest.importorskip("transformers")

from modcli_runtime.text import ByteTokenizer  # noqa: E402

from modcli.bundle.config import ExportConfig  # noqa: E402
from modcli.bundle.hf.tokenizer import bytes_tokenizer_json  # noqa: E402
from modcli.bundle.hf.writer import export_hf  # noqa: E402
from modcli.checkpoint.store import load_model_from, save_checkpoint  # noqa: E402
from modcli.cli import app  # noqa: E402
from modcli.config import DataConfig, ModelConfig, RunConfig, TrainConfig  # noqa: E402
from modcli.decode.generation import GenerateConfig, generate  # noqa: E402
from modcli.models.decoder import MoDDecoder  # noqa: E402
from tests.conftest import make_corpus_text, tiny_model_config  # noqa: E402
from tests.pretrained.test_pretrained import ARCHITECTURES, save_tiny_hf_model  # noqa: E402

ATOL = 1e-4
PROMPTS = ["def f_3(x):\n", "    return x * 2 + 1  # line"]
STEPS = 12

MODELS = {
    # name: ModelConfig overrides, routing (None: the first causal mode)
    "topk-router": (dict(), "router"),
    "topk-predictor": (dict(n_kv_heads=2, keep_first=1), "predictor"),
    "topk-mlp-router": (dict(router_hidden=16, router_weight="identity"), "router"),
    "threshold": (dict(router="threshold", predictor_hidden=0, threshold=0.4), None),
    "random": (dict(router="random", predictor_hidden=0, capacity=0.5), None),
    "attention": (dict(router="attention"), None),  # A-MoD: decodes with its predictor
    "route-attention": (dict(route_part="attention"), "router"),
    "route-mlp": (dict(route_part="mlp", router_weight="unit"), "router"),
    "kv-kept": (dict(keep_skipped_kv=True, n_kv_heads=2), "router"),  # skipped tokens keep their K/V
    "qk-norm-kv-kept": (dict(qk_norm=True, keep_skipped_kv=True, n_kv_heads=2), "router"),  # Qwen3's q/k norms
    "skip-linear": (dict(skip_update="linear", skip_rank=4), "router"),  # skipped tokens: x + U(D(x))
    "per-block-parts": (dict(route_part="attention:1,mlp:3"), "router"),  # block 1 routes attention, 3 its MLP
    "mode-staged": (dict(experts=2, expert_top_k=2), "router"),  # MoD routing + an MoE MLP in every block
    "mode-integrated": (dict(router="integrated", experts=2, noop_experts=1, predictor_hidden=0), None),
    "moe": (dict(route_every=0, experts=3, expert_top_k=1), None),
    "static-drops": (dict(drop="attention:0,mlp:2"), "router"),  # blocks 1, 3 routed; block 0 has no attention
    "moe-hash": (dict(route_every=0, experts=3, expert_routing="hash"), None),  # the expert: a table of the id
    "mode-staged-hash": (dict(experts=2, expert_routing="hash"), "router"),  # the selected tokens' ids
    "untied-biases-rope": (dict(tie_embeddings=False, qkv_bias=True, n_kv_heads=1, head_size=12, norm_eps=1e-5,
                                rope_base=50000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 8}), "router"),
}
FAST = ("topk-router", "mode-staged", "mode-staged-hash")


def save_run(root: Path, model: MoDDecoder, tokenizer: str = "bytes", state: dict | None = None) -> Path:
    run = RunConfig(model=model.config, data=DataConfig(tokenizer=tokenizer), train=TrainConfig(out=str(root)))
    save_checkpoint(root, 1, model, None, run, {"step": 1, **(state or {})}, keep=1)
    return root


@torch.no_grad()
def decided_model(config: ModelConfig, seed: int = 0) -> MoDDecoder:
    """A random model whose causal decisions lie far from their cut, so that float noise between two implementations
    cannot flip one: routers' and predictors' output layers scaled up, and their bias set so that some tokens are
    processed and some skipped."""
    torch.manual_seed(seed)
    model = MoDDecoder(config).eval()
    for name, weight in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):  # not the 1 they start at: a mix-up would show
            weight.uniform_(0.5, 1.5)
        if name.endswith("skip.up.weight"):  # not the 0 it starts at (the identity path)
            weight.normal_(std=0.2)
    for block in model.blocks:
        router = block.router
        cuts = ((getattr(router, "score", None), getattr(router, "logit_threshold", 0.0)),
                (getattr(router, "predictor", None), 0.0))
        for network, cut in cuts:
            if network is None:
                continue
            last = [m for m in network.modules() if isinstance(m, torch.nn.Linear)][-1]
            last.weight.mul_(40.0)
            last.bias.fill_(cut)
    return model


def export(run: Path, out: Path, **options):
    return export_hf(ExportConfig(checkpoint=str(run), out=str(out), hf=True, **options))


def load(folder: Path, remote: bool = True):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=remote).eval()


class TokenCounter:
    """Tokens entering the attention and MLP of the given blocks (forward pre-hooks), per call."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.calls: list[tuple[int, int]] = []  # (rows, tokens per row) of each call
        self.handles = [m.register_forward_pre_hook(self.hook) for m in modules]

    def hook(self, module, args) -> None:
        x = args[0]
        self.calls.append((x.shape[0], x.shape[1]))

    def total(self) -> int:
        return sum(rows * tokens for rows, tokens in self.calls)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (run, folder), exported once per module."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            overrides, routing = MODELS[name]
            root = tmp_path_factory.mktemp(name)
            run = save_run(root / "run", decided_model(tiny_model_config(**overrides)))
            result = export(run, root / "hf", routing=routing)
            assert result.checked and all(c.passed for c in result.checks), result.checks
            cache[name] = (run, root / "hf")
        return cache[name]

    return get


# ------------------------------------------------------------------------------------------------- the folder


def test_the_bytes_tokenizer_maps_byte_b_to_id_b(tmp_path):
    from tokenizers import Tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(bytes_tokenizer_json()))
    tokenizer = Tokenizer.from_file(str(path))
    text = "héllo\t wörld 😀\n    \"\"\"x\"\"\"\x00"
    assert tokenizer.encode(text).ids == list(text.encode("utf-8"))
    assert tokenizer.decode(list(range(256))) == ByteTokenizer().decode(list(range(256)))  # invalid UTF-8 too
    assert tokenizer.decode(list(text.encode("utf-8"))) == text


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in MODELS])
@torch.no_grad()
def test_the_folder_equals_modcli_logits_generate_and_routed_work(name, exported):
    run, folder = exported(name)
    model, _, _ = load_model_from(run)
    routing = MODELS[name][1] or (model.causal_modes() or ("dense",))[0]
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_modcli.ModcliForCausalLM"
    assert {"configuration_modcli.py", "modeling_modcli.py", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json", "README.md"} <= {p.name for p in folder.iterdir()}
    hf = load(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)

    # logits: random tokens and text, under the run's causal mode
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf(tokens).logits, model(tokens, routing), atol=ATOL, rtol=0)

    # generate(): batch 1 and a left-padded batch of 2, greedy, with the KV cache = modcli generate's tokens
    want = generate(GenerateConfig(checkpoint=str(run), prompts=PROMPTS, max_new_tokens=STEPS, temperature=0,
                                   routing=routing, device="cpu"))
    single = tokenizer(PROMPTS[1], return_tensors="pt")
    assert single["input_ids"][0].tolist() == list(PROMPTS[1].encode())
    routed = [block for block, ours in zip(hf.blocks, model.blocks, strict=True) if ours.routed]
    attention, mlp = TokenCounter([b.attn for b in routed]), TokenCounter([b.mlp for b in routed])
    alone = hf.generate(**single, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    attention.remove()
    mlp.remove()
    assert alone[0, single["input_ids"].shape[1]:].tolist() == want.tokens[1]
    batch = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    out = hf.generate(**batch, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    assert out[:, batch["input_ids"].shape[1]:].tolist() == want.tokens

    # a skipped token costs no block work: the tokens entering routed blocks' attention and MLP are exactly those
    # modcli's causal pass over the same tokens processes (the prompt and every generated token but the last)
    if routed:
        fed = alone[:, :single["input_ids"].shape[1] + STEPS - 1]  # (1, P + N - 1)
        _, aux = model(fed, routing, return_aux=True)
        processed = sum(int(record.selection.counts.sum()) for record in aux.records)
        every = fed.shape[1] * len(routed)
        parts = {record.layer: (int(record.selection.counts.sum()), model.config.route_part_at(record.layer))
                 for record in aux.records}  # a per-block --route-part: each block its own part
        assert attention.total() == sum(n if part != "mlp" else fed.shape[1] for n, part in parts.values())
        assert mlp.total() == sum(n if part != "attention" else fed.shape[1] for n, part in parts.values())
        assert 0 < processed < every


def test_hash_routing_travels_as_a_table_in_the_weights(exported):
    """A hash-routed MoE has no gate in the folder; its table (token id -> expert) is an integer tensor of the
    safetensors, loaded as the remote model's buffer, and the config says how the expert is chosen."""
    from safetensors.torch import load_file

    run, folder = exported("mode-staged-hash")
    model, _, _ = load_model_from(run)
    assert json.loads((folder / "config.json").read_text())["expert_routing"] == "hash"
    state = load_file(str(folder / "model.safetensors"))
    assert not any(".mlp.gate." in name for name in state)
    hf = load(folder)
    for ours, theirs in zip(model.blocks, hf.blocks, strict=True):
        assert state[f"blocks.{ours.layer}.mlp.hash_table"].dtype == torch.int64
        assert torch.equal(theirs.mlp.hash_table, ours.mlp.hash_table)


@torch.no_grad()
def test_decode_steps_skip_whole_rows_of_a_batch(exported):
    """In a left-padded batch of 2, a routed block's decode step takes only the rows whose token it processes."""
    run, folder = exported("topk-router")
    hf = load(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    routed = [hf.blocks[layer] for layer in hf.config.routed_layers]
    counter = TokenCounter([block.attn for block in routed])
    batch = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    hf.generate(**batch, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    counter.remove()
    decode_rows = [rows for rows, tokens in counter.calls if tokens == 1]
    assert decode_rows and all(rows in (1, 2) for rows in decode_rows)
    assert 1 in decode_rows  # some steps left a row out altogether


def test_the_remote_files_import_only_torch_and_transformers():
    import ast

    from modcli.bundle.hf.convert import REMOTE, REMOTE_FILES

    for name in REMOTE_FILES:
        tree = ast.parse((REMOTE / name).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and not node.level}
        assert imported <= {"__future__", "math", "torch", "transformers"}, (name, imported)


@pytest.mark.slow
def test_the_modeling_file_needs_no_modcli(exported, tmp_path):
    """Loaded in a fresh interpreter where importing modcli fails, the folder gives modcli's logits."""
    run, folder = exported("mode-staged")
    model, _, _ = load_model_from(run)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    script = f"""
import sys, json, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("modcli", "modcli_runtime"):
            raise ImportError("modcli must not be imported: " + name)
sys.meta_path.insert(0, Block())
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(torch.tensor({tokens.tolist()})).logits
assert not [m for m in sys.modules if m.split(".")[0] == "modcli"]
print(json.dumps(logits[0].tolist()))
"""
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.tensor(json.loads(done.stdout.splitlines()[-1]))
    with torch.no_grad():
        torch.testing.assert_close(got, model(tokens, "router")[0], atol=ATOL, rtol=0)


def remote_modeling(monkeypatch):
    """The folder's modeling_modcli.py, imported as the package transformers makes of a folder."""
    import importlib
    import types

    from modcli.bundle.hf.convert import REMOTE

    package = types.ModuleType("modcli_remote_under_test")
    package.__path__ = [str(REMOTE)]
    monkeypatch.setitem(sys.modules, package.__name__, package)
    for name in ("configuration_modcli", "modeling_modcli"):
        monkeypatch.delitem(sys.modules, f"{package.__name__}.{name}", raising=False)
    return importlib.import_module(f"{package.__name__}.modeling_modcli")


ROUTER_MODELS = {"topk": dict(), "threshold": dict(router="threshold", predictor_hidden=0, threshold=0.4),
                 "threshold-0": dict(router="threshold", predictor_hidden=0, threshold=0.0),
                 "random": dict(router="random", predictor_hidden=0, capacity=0.5), "attention": dict(router="attention")}


def test_every_router_kind_is_tried_here():
    from modcli.models.routing.registry import ROUTERS

    assert {tiny_model_config(**overrides).router for overrides in ROUTER_MODELS.values()} == set(ROUTERS)


@pytest.mark.parametrize("name", ROUTER_MODELS)
@torch.no_grad()
def test_each_router_exports_its_causal_rule_and_the_remote_code_decides_alike(name, monkeypatch):
    """Every causal mode of every router kind names an exported rule (modcli.models.routing.base.ExportedRule) that
    the remote code implements; the folder's config.json carries it, and the remote router built from that config
    and the router's weights decides exactly as modcli's router and weighs the update alike. Full-sequence modes have
    no exported rule."""
    from modcli.bundle.hf.convert import convert

    modeling = remote_modeling(monkeypatch)
    model = decided_model(tiny_model_config(**ROUTER_MODELS[name]))
    config = model.config
    if name == "threshold-0":  # decided_model put the bias at the cut, -inf here: make the logits finite again
        for block in model.blocks:
            if block.router is not None:
                block.router.score.bias.fill_(0.0)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(3, 20, config.d_model, generator=generator)  # (B, T, D)
    positions = torch.arange(40, 60)[None].expand(3, -1)  # (B, T) past the prompt, as when decoding
    routers = [block.router for block in model.blocks if block.router is not None]
    for mode in routers[0].modes():
        if not routers[0].capabilities.is_causal(mode):
            assert all(router.exported_rule(mode) is None for router in routers)
            continue
        folder_config = modeling.ModcliConfig(**convert(model, mode, None, torch.float32).config)
        for router in routers:
            rule = router.exported_rule(mode)
            assert rule is not None and (folder_config.route_decision, folder_config.route_cut,
                                         folder_config.route_score) == (rule.name, rule.cut, rule.weighted)
            theirs = modeling.Router(folder_config, router.layer)
            assert rule.name in theirs.rules
            theirs.load_state_dict(router.state_dict())  # the names the folder's weights have
            logits = router.logits(x, positions)
            want = router.decide(x, logits, mode, positions, config.capacity)
            their_logits = theirs.logits(x)
            got = theirs.decide(x, their_logits, positions)
            assert torch.equal(got, want), (mode, router.layer)
            if rule.name == "score" and rule.cut is None:
                assert bool(want.all())  # p = 0: every token passes
            else:
                assert 0 < int(want.sum()) < want.numel()  # some tokens processed, some skipped
            if rule.weighted:
                torch.testing.assert_close(theirs.weight_function(their_logits), router.weight(logits), atol=0,
                                           rtol=0)
            else:
                assert their_logits is None and torch.equal(router.weight(logits), torch.ones_like(logits))


def test_the_model_card_names_the_fields_that_matter(exported):
    _, folder = exported("topk-router")
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers")
    for field in ("base model", "router", "capacity", "causal rule", "quality", "compute", "speed", "check"):
        assert f"| {field} |" in card
    assert "`router`: router logit > 0" in card and "| capacity | 0.25" in card and "passed" in card


# --------------------------------------------------------------------------- imported Llama/Mistral/Qwen2/Qwen3

@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def imported(request, tmp_path_factory):
    """(name, original folder, the transformers model, the imported modcli run)."""
    root = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_hf_model(request.param, root / "original")
    result = CliRunner().invoke(app, ["import", str(root / "original"), "--out", str(root / "run")])
    assert result.exit_code == 0, result.output
    return request.param, root / "original", reference, root / "run"


@torch.no_grad()
def test_a_dense_imported_model_exports_as_its_plain_architecture(imported, tmp_path):
    name, original, reference, run = imported
    result = export(run, tmp_path / "hf")
    assert not result.remote_code and result.architecture == reference.config.architectures[0]
    folder = tmp_path / "hf"
    assert not list(folder.glob("*.py")) and "auto_map" not in json.loads((folder / "config.json").read_text())
    hf = load(folder, remote=False)
    assert type(hf).__name__ == type(reference).__name__
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf(tokens).logits, reference(tokens).logits, atol=ATOL, rtol=0)
    text = make_corpus_text(3)  # tokenized as transformers tokenizes for the original folder
    tokenizer, theirs = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in (folder, original))
    assert tokenizer(text)["input_ids"] == theirs(text)["input_ids"]
    assert "imported with `modcli import`" in (folder / "README.md").read_text()


@torch.no_grad()
def test_a_converted_imported_model_round_trips_with_remote_code(imported, tmp_path):
    """The imported model made Mixture-of-Depths (its dense weights, a router on every other block, as --init-from
    does): GQA, biases, tied and untied heads and Llama-3 RoPE scaling all survive the remote-code folder."""
    name, original, reference, run = imported
    dense, run_config, _ = load_model_from(run)
    config = ModelConfig(**{**run_config.model.__dict__, "route_every": 2, "route_offset": 1, "capacity": 0.5,
                            "router_weight": "unit", "predictor_hidden": 16})
    model = decided_model(config)
    model.load_state_dict(dense.state_dict(), strict=False)
    converted = save_run(tmp_path / "converted", model, tokenizer=str((run / "tokenizer.json").resolve()),
                         state={"imported_from": str(original), "architecture": reference.config.architectures[0]})
    result = export(converted, tmp_path / "hf")
    assert result.remote_code and all(c.passed for c in result.checks)
    hf = load(tmp_path / "hf")
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(hf(tokens).logits, model(tokens, "router"), atol=ATOL, rtol=0)
    assert hf.config.qkv_bias == (name == "qwen2") and hf.config.qk_norm == (name == "qwen3")
    assert hf.config.tie_word_embeddings == (name in ("qwen2", "qwen3"))


def test_an_early_exit_model_exports_at_full_depth_as_plain_llama(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(d_model=32, n_layers=3, n_heads=4, seq_len=32, arch="early-exit")
    model = config.family.model_class()(config).eval()
    result = export(save_run(tmp_path / "run", model), tmp_path / "hf")
    assert result.architecture == "LlamaForCausalLM" and not result.remote_code
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path / "hf", remote=False)(tokens).logits, model(tokens), atol=ATOL,
                                   rtol=0)


# ------------------------------------------------------------------------------------------------- bad input


def invoke(*args: str):
    return CliRunner().invoke(app, ["export", *args])


def one_red_line(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr


def test_bad_input_is_one_line_and_exit_2(exported, tmp_path):
    run, folder = exported("topk-router")
    (tmp_path / "not-a-run").mkdir()
    one_red_line(invoke(str(tmp_path / "not-a-run"), "--hf", "--out", str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    one_red_line(invoke(str(run), "--hf", "--out", str(busy)), "--force")
    one_red_line(invoke(str(run), "--hf", "--out", str(busy), "--force"), "refusing")
    assert (busy / "notes.txt").read_text() == "mine"
    one_red_line(invoke(str(run), "--hf", "--out", str(folder)), "--force")  # an existing export, no --force
    one_red_line(invoke(str(run), "--hf", "--onnx", "--out", str(tmp_path / "y")), "--onnx")
    one_red_line(invoke(str(run), "--hf", "--routing", "topk", "--out", str(tmp_path / "y")), "topk")
    assert not (tmp_path / "y").exists()


def test_a_causal_mode_its_router_cannot_export_is_refused_in_one_line(exported, tmp_path, monkeypatch):
    from modcli.models.routing.topk import TopKRouter

    run, _ = exported("topk-router")
    exported_rule = TopKRouter.exported_rule
    monkeypatch.setattr(TopKRouter, "exported_rule",
                        lambda self, mode: None if mode == "predictor" else exported_rule(self, mode))
    one_red_line(invoke(str(run), "--hf", "--routing", "predictor", "--out", str(tmp_path / "hf")),
                 "--routing predictor", "Hugging Face", "router")
    assert not (tmp_path / "hf").exists()


def test_force_replaces_an_earlier_export_and_json_reports_it(exported, tmp_path):
    run, _ = exported("topk-router")
    out = tmp_path / "hf"
    assert invoke(str(run), "--hf", "--out", str(out)).exit_code == 0
    result = invoke(str(run), "--hf", "--out", str(out), "--force", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["remote_code"] and report["checked"] and report["routing"] == "router"
    assert {c["case"] for c in report["checks"]} >= {"left-padded B=2"}


def test_without_transformers_the_folder_is_written_unchecked_and_says_so(exported, tmp_path, monkeypatch):
    import importlib.util

    run, _ = exported("topk-router")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformers" else find_spec(name, *args))
    result = export(run, tmp_path / "hf")
    assert not result.checked and not result.checks and (tmp_path / "hf" / "model.safetensors").is_file()
    assert "| check | not checked: transformers is not installed |" in (tmp_path / "hf" / "README.md").read_text()


def test_an_unsupported_family_is_refused_with_the_reason(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig.of(d_model=32, n_layers=5, n_heads=4, seq_len=32, arch="recursion", recursions=3,
                         predictor_hidden=16)
    run = save_run(tmp_path / "run", config.family.model_class()(config))
    one_red_line(invoke(str(run), "--hf", "--out", str(tmp_path / "hf")), "recursion", "Hugging Face")
    assert not (tmp_path / "hf").exists()
