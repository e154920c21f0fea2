"""The compiled paths (issue 13): the static-shape decoder equals eager decoding, torch.compile leaves one graph per
path, and --compile works through train, generate and profile.

Compiling costs seconds even for tiny models on 2 cores, so the compiled checks are few and share models; the
static decoder's maths is checked eagerly (compile=False runs the same modules) for every variant.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.compiling import CompileStats, compile_module, first_call
from modcli.decode.static import StaticDecoder
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from tests.conftest import tiny_model_config

HASH = {"experts": 2, "expert_routing": "hash"}  # staged MoDE whose experts a table of the token id chooses
ATOL = 1e-4
runner = CliRunner()
CPU = torch.device("cpu")


def _model(**overrides) -> MoDDecoder:
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(**overrides)).eval()
    with torch.no_grad():  # router biases near zero make about half the tokens pass: both branches get used
        for block in model.blocks:
            if block.router is not None and hasattr(block.router, "score"):
                block.router.score.bias.fill_(0.0)
    return model


@torch.no_grad()
def _eager_and_static(model: MoDDecoder, routing: str, compile: bool, lengths=(5, 17, 11), steps: int = 8,
                      branch_free: bool | None = None, processed: list[int] | None = None):
    """Logits of a padded prefill then `steps` decode steps, eager (DecoderCache) and static; both caches.
    `processed` receives, per eager step and routed layer, how many rows stored the token."""
    batch = len(lengths)
    tokens = torch.randint(0, model.config.vocab_size, (batch, max(lengths)))
    lengths = torch.tensor(lengths)
    new_tokens = torch.randint(0, model.config.vocab_size, (steps, batch))
    rows = torch.arange(batch)
    cache = DecoderCache.allocate(model.config, batch, max(lengths) + steps, CPU)
    eager = [model(tokens, routing, cache=cache, lengths=lengths)[rows, lengths - 1]]
    for step in range(steps):
        before = [layer.lengths.clone() for layer in cache.layers]
        eager.append(model.decode_step(new_tokens[step], cache, routing))
        if processed is not None:
            processed += [int((cache.layers[layer].lengths - before[layer]).sum())
                          for layer in model.config.routed_layers()]
    static = StaticDecoder(model, batch, int(max(lengths)) + steps, routing, CPU, compile=compile,
                           branch_free=branch_free)
    static.warm_up(tokens, lengths)
    got = [static.prefill(tokens, lengths)[rows, lengths - 1]]
    got += [static.step(new_tokens[step]) for step in range(steps)]
    return torch.stack(eager), torch.stack(got), cache, static


@pytest.mark.slow
@pytest.mark.parametrize("overrides, routing", [
    ({}, "router"), ({}, "predictor"), ({"route_every": 0}, "dense"), ({"route_part": "mlp"}, "router"),
    ({"route_part": "attention"}, "router"), ({"router": "threshold"}, None), ({"router": "random"}, None),
    ({"n_kv_heads": 2}, "router"), ({"experts": 2}, "router"), ({"keep_first": 6}, "router"),
    (HASH, "router"), ({**HASH, "route_part": "mlp"}, "router"), ({**HASH, "route_part": "attention"}, "router"),
    ({**HASH, "route_every": 0}, "dense"),
    ({"qk_norm": True, "n_kv_heads": 2}, "router"),  # Qwen3's q/k norms
])
def test_static_decoder_equals_eager_decoding(overrides, routing):
    model = _model(**overrides)
    routing = routing or model.causal_modes()[0]
    eager, static_logits, cache, static = _eager_and_static(model, routing, compile=False)
    torch.testing.assert_close(static_logits, eager, atol=ATOL, rtol=0)
    for layer in range(model.config.n_layers):  # each layer stored exactly what the eager cache stored
        assert static.cache.layers[layer].lengths.tolist() == cache.layers[layer].lengths.tolist(), layer
    assert static.cache.positions.tolist() == cache.positions.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, HASH])
def test_row_capped_steps_equal_eager_decoding_on_both_sides_of_the_cap(overrides):
    """Batch 6, capacity 0.25: a routed block computes at most 3 gathered rows when few rows process the token, all
    rows otherwise; both kinds of step occur here and both equal eager decoding (a hash-routed MoE gets the
    gathered rows' ids)."""
    model = _model(**overrides)
    lengths = (3, 9, 5, 7, 4, 8)
    counts: list[int] = []  # rows that processed each step, per routed block, in the very run compared
    eager, static_logits, cache, static = _eager_and_static(model, "router", compile=False, lengths=lengths, steps=10,
                                                            processed=counts)
    torch.testing.assert_close(static_logits, eager, atol=ATOL, rtol=0)
    assert static._step_module.graph.row_cap == 3
    assert min(counts) <= 3 < max(counts)
    for layer in range(model.config.n_layers):
        assert static.cache.layers[layer].lengths.tolist() == cache.layers[layer].lengths.tolist()


@pytest.mark.slow
def test_branch_free_static_decoder_equals_eager_decoding():
    """The CUDA-graph form: a routed block's work on every step, skipped rows discarded and not stored."""
    model = _model()
    eager, branch_free, cache, static = _eager_and_static(model, "router", compile=False, branch_free=True)
    assert static.branch_free
    torch.testing.assert_close(branch_free, eager, atol=ATOL, rtol=0)
    for layer in range(model.config.n_layers):
        assert static.cache.layers[layer].lengths.tolist() == cache.layers[layer].lengths.tolist()


@pytest.mark.slow
def test_static_cache_is_preallocated_and_keeps_its_address():
    model = _model()
    static = StaticDecoder(model, 2, 40, "router", CPU, compile=False)
    addresses = [layer.keys.data_ptr() for layer in static.cache.layers]
    assert all(layer.slots == 40 for layer in static.cache.layers)
    with torch.no_grad():
        static.prefill(torch.randint(0, 256, (2, 30)))
        for _ in range(10):
            static.step(torch.randint(0, 256, (2,)))
    assert [layer.keys.data_ptr() for layer in static.cache.layers] == addresses


@pytest.fixture(scope="module")
def compiled_run():
    """One tiny MoD model decoded through the compiled static decoder (compiling once for the module)."""
    model = _model(d_model=32, n_layers=2, n_heads=2)
    eager, compiled, cache, static = _eager_and_static(model, "router", compile=True, lengths=(4, 9), steps=6)
    return eager, compiled, cache, static


@pytest.mark.slow
def test_compiled_decoding_equals_eager_decoding_and_is_one_graph(compiled_run):
    eager, compiled, cache, static = compiled_run
    torch.testing.assert_close(compiled, eager, atol=ATOL, rtol=0)
    for layer in range(len(cache.layers)):
        assert static.cache.layers[layer].lengths.tolist() == cache.layers[layer].lengths.tolist()
    assert static.compile_stats.graph_breaks == 0
    assert static.compile_stats.compile_s > 0


@pytest.mark.slow
@torch.no_grad()
def test_a_batch_of_one_decodes_without_compiling_again_after_warm_up():
    # At B = 1, tokens[:, 0].contiguous() keeps the stride of T; the real steps' tokens have stride 1, which failed
    # a guard, so the first real step compiled the decode step a second time (seconds, inside the decode timing).
    model = _model(d_model=24, n_layers=2, n_heads=2)
    tokens = torch.randint(0, 256, (1, 12))
    static = StaticDecoder(model, 1, 20, "router", CPU, compile=True)
    static.warm_up(tokens)
    static.prefill(tokens)
    new_tokens = torch.randint(0, 256, (4, 1))  # rows (1,) with stride 1, as generate's sampled tokens
    with torch.compiler.set_stance("fail_on_recompile"):
        for step in range(4):
            static.step(new_tokens[step])


@pytest.mark.slow
@torch.no_grad()
def test_compiled_forward_and_causal_prefill_have_no_graph_breaks():
    model = _model(d_model=32, n_layers=2, n_heads=2)
    tokens = torch.randint(0, 256, (2, 24))
    for routing in ("topk", "router"):
        stats = CompileStats()
        compiled = compile_module(lambda t, routing=routing: model(t, routing), CPU, dynamic=None)
        logits = first_call(lambda compiled=compiled: compiled(tokens), stats)
        torch.testing.assert_close(logits, model(tokens, routing), atol=ATOL, rtol=0)
        assert stats.graph_breaks == 0, stats.break_reasons


@pytest.mark.slow
def test_generate_compile_gives_the_eager_text(tmp_path, trained_run):
    args = ["generate", str(trained_run), "--prompt", "def f", "--prompt", "import", "--max-new-tokens", "12",
            "--temperature", "0", "--json"]
    eager = runner.invoke(app, args)
    compiled = runner.invoke(app, [*args, "--compile"])
    assert eager.exit_code == 0 and compiled.exit_code == 0, compiled.stderr
    eager, compiled = json.loads(eager.stdout), json.loads(compiled.stdout)
    assert compiled["texts"] == eager["texts"]
    assert compiled["graph_breaks"] == 0 and compiled["compile_s"] > 0
    assert eager["compile_s"] is None
    assert compiled["linear_kernel"] == "aten"  # the packed kernel is for eager decoding only (modcli.packed_linear)


def test_static_decoding_refuses_a_family_without_a_decode_graph():
    from modcli.errors import UserError
    from modcli.models.recursion import RecursionDecoder
    from tests.models.test_recursion import recursion_config

    model = RecursionDecoder(recursion_config()).eval()
    with pytest.raises(UserError, match="--compile.*recursion"):
        StaticDecoder(model, 1, 16, "router", CPU, compile=False)


def test_generate_compile_refuses_exit_decoding(trained_run):
    result = runner.invoke(app, ["generate", str(trained_run), "--compile", "--exit-threshold", "0.9"])
    assert result.exit_code == 2
    assert "--compile" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_train_compile_matches_eager_training(tmp_path, corpus_file):
    flags = ["train", "--data", str(corpus_file), "--preset", "tiny", "--d-model", "32", "--n-layers", "2", "--n-heads",
             "2", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1",
             "--device", "cpu", "--json"]
    eager = runner.invoke(app, [*flags, "--out", str(tmp_path / "eager")])
    compiled = runner.invoke(app, [*flags, "--out", str(tmp_path / "compiled"), "--compile"])
    assert eager.exit_code == 0 and compiled.exit_code == 0, compiled.stderr
    eager, compiled = json.loads(eager.stdout), json.loads(compiled.stdout)
    assert compiled["train_loss"] == pytest.approx(eager["train_loss"], abs=1e-4)
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-4)
    assert compiled["graph_breaks"] == 0 and compiled["compile_s"] > 0 and eager["compile_s"] is None


@pytest.mark.slow
def test_profile_backends(tmp_path, monkeypatch):
    from modcli.profiling import measure as profile_measure

    timed_together: list[set] = []  # the calls of each interleaved run
    interleaved = profile_measure.interleaved
    monkeypatch.setattr(profile_measure, "interleaved", lambda calls, *args, **kwargs: timed_together.append(set(calls))
                        or interleaved(calls, *args, **kwargs))
    flags = ["profile", "--preset", "tiny", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16",
             "--batch-size", "1", "--repeats", "1", "--warmup", "0", "--decode-tokens", "2", "--no-memory",
             "--device", "cpu", "--json"]
    runs = {"compiled": ("forward", {"forward"}), "onnxruntime": ("forward,decode", {"forward", "decode"})}
    for backend, (measure, timed) in runs.items():
        result = runner.invoke(app, [*flags, "--backends", f"eager,{backend}", "--measure", measure])
        assert result.exit_code == 0, result.stderr
        row = json.loads(result.stdout)["results"][0]
        for side in ("model", "baseline"):
            assert set(row[side][backend]) == timed
            assert row[side]["forward"]["latency_ms"] > 0  # eager is timed in the same interleaved run
        for name in timed:
            ratio = row["ratio"][f"{backend}_{name}_latency"]
            assert ratio["measured"] > 0 and ratio["ideal"] == row["ratio"][f"{name}_latency"]["ideal"] < 1
        if backend == "onnxruntime":  # each graph is timed in the same interleaved run as its eager twin
            for what in ("forward", "decode"):
                assert any({(side, "eager") for side in ("model", "baseline")}
                           | {(side, "onnxruntime", what) for side in ("model", "baseline")} <= calls
                           for calls in timed_together), timed_together
        if backend == "compiled":
            assert row["model"]["compiled"]["forward"]["graph_breaks"] == 0
            assert row["model"]["compiled"]["forward"]["compile_s"] > 0
    bad = runner.invoke(app, [*flags, "--backends", "eager,tensorrt"])
    assert bad.exit_code == 2 and "--backends" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
