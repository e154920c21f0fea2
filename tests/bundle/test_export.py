"""`modcli export`: ONNX and AOTInductor graphs equal eager PyTorch, the bundle is complete, bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from modcli.bundle.onnx_walk import names_read, op_types
from modcli.bundle.validation import validation_lengths
from modcli.bundle.writer import ExportConfig, export
from modcli.checkpoint.store import load_model_from, save_checkpoint
from modcli.cli import app
from modcli.config import RunConfig, TrainConfig
from modcli.decode.graphs import DecodeStepGraph, ForwardGraph
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from tests.conftest import make_corpus_text, tiny_model_config

ATOL = 1e-4
_BUNDLES: dict[tuple[str, str], Path] = {}


def exported_bundle(run: Path, root: Path, name: str = "mod") -> Path:
    """Export `run` once per test session (test_runtime.py shares it); ONNX graphs, CPU provider."""
    key = (str(run), name)
    if key not in _BUNDLES:
        out = root / name
        result = export(ExportConfig(checkpoint=str(run), out=str(out), provider="cpu"))
        assert result.valid, result.failures
        _BUNDLES[key] = out
    return _BUNDLES[key]


def random_checkpoint(root: Path, **overrides) -> Path:
    """An untrained checkpoint (router biases at 0: about half the tokens processed); no training needed."""
    torch.manual_seed(0)
    config = tiny_model_config(**overrides)
    model = MoDDecoder(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            if block.router is not None:
                block.router.score.bias.fill_(0.0)
            if block.skip is not None:  # --skip-update linear: not the identity path it starts as
                block.skip.up.weight.normal_(std=0.2)
    run = RunConfig(model=config, train=TrainConfig(out=str(root)))
    return save_checkpoint(root, 1, model, None, run, {"step": 1}, keep=1)


@pytest.fixture(scope="module")
def bundle(trained_run, tmp_path_factory) -> Path:
    return exported_bundle(trained_run, tmp_path_factory.mktemp("bundles"))


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


# ----------------------------------------------------------------------------------------------- the graphs


@torch.no_grad()
def test_forward_wrapper_equals_the_model_topk_forward():
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config()).eval()
    wrapper = ForwardGraph(model)
    for length in (1, 3, 7, 8, 9, 32):
        tokens = torch.randint(0, 256, (2, length))
        logits, aux = model(tokens, "topk", return_aux=True)
        records = aux.records
        outputs = wrapper(tokens)
        torch.testing.assert_close(outputs[0], logits, atol=ATOL, rtol=0)
        for selected, record in zip(outputs[1:], records, strict=True):
            assert torch.equal(selected, record.selection.selected_idx)


@pytest.mark.slow
@pytest.mark.parametrize("routing, part, kv_heads, experts", [
    ("router", "block", 0, {}), ("predictor", "block", 2, {}), ("router", "mlp", 0, {}), ("router", "attention", 2, {}),
    *[("router", part, 0, {"experts": 3, "expert_routing": "hash"}) for part in ("block", "mlp", "attention")],
    ("router", "block", 2, {"qk_norm": True}),  # Qwen3's q/k norms
])
@torch.no_grad()
def test_decode_wrapper_equals_decode_step_with_the_kv_cache(routing, part, kv_heads, experts):
    """The read-only decode graph plus `write_new_rows` into static buffers = eager decode_step, for every
    --route-part, grouped key/value heads and hash-routed experts (which read the token ids); the graph's new rows
    have slot dim 1."""
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(route_part=part, n_kv_heads=kv_heads, **experts)).eval()
    for block in model.blocks:
        if block.router is not None:
            block.router.score.bias.fill_(0.0)
    config = model.config
    wrapper = DecodeStepGraph(model, routing)
    assert wrapper.processed_row_layers == (() if part == "mlp" else tuple(config.routed_layers()))
    assert all(wrapper.writes_every_row(layer) == (layer not in wrapper.processed_row_layers)
               for layer in range(config.n_layers))
    batch, steps = 3, 20
    tokens = torch.randint(0, 256, (batch, steps))
    cache = DecoderCache.allocate(config, batch, steps, torch.device("cpu"))
    flat = []  # static buffers of `steps` slots, written in place (gpt-fast style)
    for _ in range(config.n_layers):
        flat += [torch.zeros(batch, config.kv_heads, steps, config.head_dim),
                 torch.zeros(batch, config.kv_heads, steps, config.head_dim), torch.zeros(batch, dtype=torch.long)]
    buffers = [t.data_ptr() for t in flat]
    for t in range(steps):
        expected = model.decode_step(tokens[:, t], cache, routing)
        outputs = wrapper(tokens[:, t], torch.full((batch,), t), *flat)
        assert len(outputs) == len(wrapper.output_names)
        assert all(o.shape == (batch, config.kv_heads, 1, config.head_dim) for o in outputs[1:1 + 2 * config.n_layers])
        torch.testing.assert_close(outputs[0], expected, atol=ATOL, rtol=0)
        wrapper.write_outputs(outputs, flat)
    assert [t.data_ptr() for t in flat] == buffers  # written in place
    for layer in range(config.n_layers):
        lengths = cache.layers[layer].lengths
        assert flat[3 * layer + 2].tolist() == lengths.tolist()
        for row in range(batch):  # the stored K/V equal the eager cache's, slot for slot
            stored = int(lengths[row])
            torch.testing.assert_close(flat[3 * layer][row, :, :stored], cache.layers[layer].keys[row, :, :stored],
                                       atol=1e-5, rtol=0)
    routed = [layer for layer in config.routed_layers() if config.attention_is_routed(layer)]
    assert all(0 < cache.layers[layer].lengths.sum() < batch * steps for layer in routed)  # both branches used


@pytest.mark.slow
def test_write_new_rows_keeps_only_the_rows_that_keep_their_kv_in_place():
    from modcli.decode.graphs import write_new_rows

    keys, values = torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5)
    before_keys, before_values = keys.clone(), values.clone()
    lengths = torch.tensor([0, 2, 3])  # each row has room, as during every valid step
    new_keys, new_values = torch.randn(3, 2, 1, 5), torch.randn(3, 2, 1, 5)
    writes = torch.tensor([True, False, False])
    addresses = keys.data_ptr(), values.data_ptr()
    new_lengths = write_new_rows(keys, values, lengths, new_keys, new_values, writes)
    assert (keys.data_ptr(), values.data_ptr()) == addresses  # in place
    assert new_lengths.tolist() == [1, 2, 3] and lengths.tolist() == [0, 2, 3]
    assert torch.equal(keys[0, :, 0], new_keys[0, :, 0]) and torch.equal(values[0, :, 0], new_values[0, :, 0])
    assert torch.equal(keys[0, :, 1:], before_keys[0, :, 1:])
    for row, length in ((1, 2), (2, 3)):  # rows that keep nothing: every slot of their length bit for bit
        assert torch.equal(keys[row, :, :length], before_keys[row, :, :length])
        assert torch.equal(values[row, :, :length], before_values[row, :, :length])
    assert write_new_rows(keys, values, new_lengths, new_keys, new_values, None).tolist() == [2, 3, 4]
    assert torch.equal(keys[1, :, 2], new_keys[1, :, 0]) and torch.equal(values[0, :, 1], new_values[0, :, 0])
    compiled = torch.compile(write_new_rows, fullgraph=True, dynamic=False)  # static shapes, no graph break
    assert compiled(keys, values, torch.tensor([3, 0, 1]), new_keys, new_values, writes).tolist() == [4, 0, 1]
    assert torch.equal(keys[0, :, 3], new_keys[0, :, 0])


@pytest.mark.slow
@torch.no_grad()
def test_tied_router_scores_select_the_same_positions_in_eager_torch_export_and_onnx(tmp_path):
    """A window opening with repeated bytes (a file's triple quote) gives bit-identical router logits at the k-th
    boundary; every path must take the lower positions."""
    import onnxruntime as ort

    from modcli.bundle.lowering import export_onnx, export_program, forward_spec

    torch.manual_seed(0)
    # The first block is routed, so its router reads the embedding: equal bytes give bit-identical logits.
    model = MoDDecoder(tiny_model_config(n_layers=2, route_every=2, route_offset=0, capacity=0.125)).eval()
    quote = ord('"')
    model.blocks[0].router.score.weight.copy_(10 * model.embed.weight[quote][None])  # '"' scores far above the rest
    model.blocks[0].router.score.bias.zero_()
    text = list(b'"""Tied scores at the k-th boundary."""\n')
    tokens = torch.tensor([text[:16], text[:8] + text[:8]])  # (2, 16): k = 2 of three tied quotes
    logits, aux = model(tokens, "topk", return_aux=True)
    records = aux.records
    eager = records[0].selection.selected_idx
    assert eager.tolist() == [[0, 1], [0, 1]]

    spec = forward_spec(model)
    program = export_program(spec)
    exported = program.module()(tokens)
    assert torch.equal(exported[1], eager)
    path = tmp_path / "forward.onnx"
    export_onnx(spec, program, path, 18)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    onnx_logits, onnx_selected = session.run(None, {"tokens": tokens.numpy()})
    assert onnx_selected.tolist() == eager.tolist()
    np.testing.assert_allclose(onnx_logits, logits.numpy(), atol=ATOL, rtol=0)


def test_a_choice_that_differs_only_at_a_tie_is_ambiguous_not_failed():
    from modcli.bundle.validation import topk_choice_is_ambiguous

    scores = np.array([[1.0, 1.0, 1.0, 0.5, 2.0]])
    reference = np.array([[0, 4]])
    assert topk_choice_is_ambiguous(scores, reference, np.array([[1, 4]]), atol=1e-4)  # another of the tied ones
    assert not topk_choice_is_ambiguous(scores, reference, np.array([[3, 4]]), atol=1e-4)  # 0.5 is no tie
    near = np.array([[1.0, 1.00005, 0.2, 2.0]])
    assert topk_choice_is_ambiguous(near, np.array([[1, 3]]), np.array([[0, 3]]), atol=1e-4)
    assert not topk_choice_is_ambiguous(near, np.array([[1, 3]]), np.array([[0, 3]]), atol=1e-6)


def test_validation_lengths_cover_every_rounding_of_k():
    config = tiny_model_config(capacity=0.125, seq_len=64)
    lengths = validation_lengths(config)
    ks = {config.capacity_tokens(t) for t in lengths}
    assert {1, 2} <= ks and {7, 8, 9, 64} <= set(lengths) and min(lengths) == 1


# ----------------------------------------------------------------------------------------------- the bundle


@pytest.mark.slow
def test_bundle_is_valid_and_its_manifest_describes_it(bundle):
    from modcli_runtime.bundle import sha256_of

    from modcli.bundle.lowering import onnx_summary

    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["valid"] is True and manifest["validation"]["status"] == "passed"
    assert manifest["opset"] == 18 and manifest["versions"]["torch"] == torch.__version__
    assert manifest["operators"] == "onnxruntime"  # RMSNorm fused (modcli.bundle.fusion); --opset-only: "onnx"
    assert manifest["graphs"]["forward"]["fused"] == {"SimplifiedLayerNormalization": 9, "RotaryEmbedding": 4}
    # decode: one per block, and a routed block's again in its row-capped branch
    assert manifest["graphs"]["decode"]["fused"]["RotaryEmbedding"] == onnx_summary(bundle / "decode.onnx")[0][
        "RotaryEmbedding"] >= 4
    assert manifest["graphs"]["decode"]["operators"] == "onnxruntime"
    assert set(manifest["files"]) == {"forward.onnx", "decode.onnx", "cache_write.onnx", "config.json"}
    assert manifest["graphs"]["cache_write"]["kind"] == "onnx"
    for name, entry in manifest["files"].items():
        assert sha256_of(bundle / name) == entry["sha256"]
    forward, decode = manifest["graphs"]["forward"], manifest["graphs"]["decode"]
    assert forward["routing"] == "topk" and forward["causal"] is False and "non-causal" in forward["note"]
    assert decode["routing"] == "router" and decode["causal"] is True
    assert forward["inputs"] == [{"name": "tokens", "shape": ["batch", "seq"], "dtype": "int64"}]
    assert forward["outputs"][0] == {"name": "logits", "shape": ["batch", "seq", 256], "dtype": "float32"}
    assert forward["outputs"][1]["shape"] == ["batch", "capacity"]
    assert manifest["format_version"] == 3
    assert decode["inputs"][2] == {"name": "keys.0", "shape": ["batch", 4, "slots.0", 8], "dtype": "float32"}
    # The decode graph returns only this step's K/V: slot dim 1, never a cache-sized output.
    assert [o["name"] for o in decode["outputs"]] == [
        "logits", *[f"new_{kind}.{layer}" for layer in range(4) for kind in ("keys", "values")],
        "processed.1", "processed.3"]
    assert all(o["shape"] == ["batch", 4, 1, 8] for o in decode["outputs"][1:9])
    cache = decode["cache"]
    assert cache["every_row_layers"] == [0, 2] and cache["processed_row_layers"] == [1, 3]
    assert cache["local_layers"] == [] and cache["window"] == 0  # no sliding-window layer: no slot_positions inputs
    assert not any(spec["name"].startswith("slot_positions") for spec in decode["inputs"])
    assert "in place" in cache["update"]
    checks = manifest["validation"]["checks"]
    assert {c["graph"] for c in checks} == {"forward", "decode"} and all(c["passed"] for c in checks)
    assert any("B=3" in c["case"] for c in checks if c["graph"] == "decode")
    assert all(c["max_abs_diff"] <= ATOL for c in checks)
    assert not list(bundle.parent.glob(".tmp-*"))


@pytest.mark.slow
def test_onnx_forward_graph_equals_pytorch_at_new_shapes(bundle, trained_run):
    from modcli_runtime import load_bundle

    model, _, _ = load_model_from(trained_run)
    runtime = load_bundle(bundle)
    generator = torch.Generator().manual_seed(7)
    for batch, length in ((1, 2), (3, 6), (2, 8), (4, 11), (2, 40)):  # 40 > seq_len: one graph for every T
        tokens = torch.randint(0, 256, (batch, length), generator=generator)
        with torch.no_grad():
            logits, aux = model(tokens, "topk", return_aux=True)
            records = aux.records
        onnx_logits, selected = runtime.forward(tokens.numpy())
        assert np.abs(onnx_logits - logits.numpy()).max() <= ATOL
        assert [s.tolist() for s in selected] == [r.selection.selected_idx.tolist() for r in records]
        assert all(s.shape[1] == model.config.capacity_tokens(length) for s in selected)


@pytest.mark.slow
def test_onnx_decode_graph_equals_the_causal_forward(bundle, trained_run):
    """Teacher-forced decoding through the graph = one causal PyTorch forward (router rule), B > 1."""
    from modcli_runtime import load_bundle

    model, _, _ = load_model_from(trained_run)
    runtime = load_bundle(bundle)
    text = torch.tensor(list(make_corpus_text()[:30].encode()))
    noise = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(3))
    # The briefly trained router skips this text and processes random bytes: rows and steps of both kinds.
    tokens = torch.stack([text, noise, torch.cat([text[:15], noise[15:]])])  # (3, 30)
    with torch.no_grad():
        logits, aux = model(tokens, "router", return_aux=True)
        records = aux.records
    feeds = runtime.cache_spec.allocate(3, 30)
    assert feeds["keys.1"].shape[2] < 30  # routed buffers start small and grow by doubling in write_rows
    stepped, processed = [], []
    for t in range(30):
        feeds["tokens"], feeds["positions"] = tokens[:, t].numpy(), np.full(3, t)
        outputs = runtime.decode_step(feeds)
        runtime.cache_spec.write_rows(feeds, outputs)
        stepped.append(outputs["logits"])
    assert np.abs(np.stack(stepped, axis=1) - logits.numpy()).max() <= ATOL
    for record in records:
        assert feeds[f"lengths.{record.layer}"].tolist() == record.selection.counts.tolist()
        processed.append(record.selection.counts.sum().item())
    assert all(0 < p < 90 for p in processed)  # processed and skipped tokens both happened


@pytest.mark.slow
def test_decode_graph_skips_a_routed_block_with_an_if_that_reads_no_cache(bundle):
    """Each routed block sits in an If whose skip branch holds no MatMul and reads no keys/values/lengths input:
    a skipped batch does no block work and touches no cache memory."""
    import onnx

    model = onnx.load(str(bundle / "decode.onnx"))
    cache_inputs = {i.name for i in model.graph.input if i.name.split(".")[0] in ("keys", "values", "lengths")}
    ifs = [node for node in model.graph.node if node.op_type == "If"]
    assert len(ifs) == len(tiny_model_config().routed_layers())
    for node, layer in zip(ifs, tiny_model_config().routed_layers(), strict=True):
        branches = {a.name: a.g for a in node.attribute}
        assert "MatMul" in op_types(branches["then_branch"])  # in it, or in its If of few rows against all
        assert {f"keys.{layer}", f"values.{layer}"} <= names_read(branches["then_branch"])
        assert not op_types(branches["else_branch"]) & {"MatMul", "Softmax", "If"}
        assert not names_read(branches["else_branch"]) & cache_inputs
    # Nothing outside the Ifs reads a routed layer's keys or values: the skip is complete.
    outside = {name for n in model.graph.node if n.op_type != "If" for name in n.input}
    assert not outside & {f"{kind}.{layer}" for layer in tiny_model_config().routed_layers()
                          for kind in ("keys", "values")}


@pytest.mark.slow
def test_aot_inductor_package_runs_and_matches(tmp_path):
    """--compile: ExportedProgram and AOTInductor package of the top-k forward graph (a ~15 s C++ compile)."""
    checkpoint = random_checkpoint(tmp_path / "run", n_layers=1, route_offset=0)  # one routed block
    result = export(ExportConfig(checkpoint=str(checkpoint), out=str(tmp_path / "bundle"), onnx=False, compile=True,
                                 graphs=["forward"]))
    assert result.valid, result.failures
    assert {f.kind for f in result.files} == {"exported_program", "aoti"}
    assert {c.runner for c in result.checks} == {"pt2", "aoti-cpu"}
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["compile"]["aoti"] is True and manifest["compile"]["seconds"]["forward.aoti"] > 0

    from torch._inductor import aoti_load_package

    package = aoti_load_package(str(tmp_path / "bundle" / "forward.aoti.pt2"))
    model, _, _ = load_model_from(checkpoint)
    tokens = torch.randint(0, 256, (3, 21))
    with torch.no_grad():
        logits, aux = model(tokens, "topk", return_aux=True)
        records = aux.records
        outputs = package(tokens)
    torch.testing.assert_close(outputs[0], logits, atol=ATOL, rtol=0)
    assert torch.equal(outputs[1], records[0].selection.selected_idx)


# ----------------------------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_cli_exports_a_dense_model_and_replaces_a_bundle_with_force(runner, trained_dense_run, tmp_path):
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    (out / "stale.onnx").write_text("old")
    result = runner.invoke(app, ["export", str(trained_dense_run), "--out", str(out), "--graph", "decode", "--force",
                                 "--provider", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["valid"] is True and {c["graph"] for c in payload["checks"]} == {"decode"}
    assert not (out / "stale.onnx").exists() and (out / "decode.onnx").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["dense"] is True and manifest["graphs"]["decode"]["routing"] == "dense"


def test_opset_only_writes_standard_onnx_operators_and_validates(runner, trained_dense_run, tmp_path):
    import onnx

    out = tmp_path / "bundle"
    result = runner.invoke(app, ["export", str(trained_dense_run), "--out", str(out), "--graph", "forward",
                                 "--opset-only", "--provider", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["valid"] is True
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["operators"] == "onnx" and manifest["graphs"]["forward"]["fused"] == {}
    graph = onnx.load(str(out / "forward.onnx"))
    assert {node.domain for node in graph.graph.node} <= {""}
    assert not {node.op_type for node in graph.graph.node} & {"SimplifiedLayerNormalization", "RotaryEmbedding"}
    onnx.checker.check_model(graph)  # standard operators only: the ONNX checker knows every one


@pytest.mark.slow
def test_a_validation_failure_exits_non_zero_and_marks_the_bundle_invalid(runner, trained_dense_run, tmp_path,
                                                                         monkeypatch):
    import modcli.bundle.validation as validation

    real = validation.eager_forward
    monkeypatch.setattr(validation, "eager_forward", lambda model, tokens: (real(model, tokens)[0] + 1.0, [], []))
    out = tmp_path / "bundle"
    result = runner.invoke(app, ["export", str(trained_dense_run), "--out", str(out), "--graph", "forward",
                                 "--provider", "cpu"])
    assert result.exit_code == 1
    assert "validation failed" in result.stderr and "FAIL" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["valid"] is False and manifest["validation"]["failures"]


@pytest.fixture(scope="module")
def no_predictor_run(tmp_path_factory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("runs") / "no-predictor", predictor_hidden=0)


@pytest.mark.parametrize("case", ["not-a-checkpoint", "no-predictor", "bfloat16-onnx", "bad-dtype", "bad-provider",
                                  "cuda-provider", "out-exists", "force-on-a-foreign-folder", "nothing-to-export",
                                  "bad-graph", "topk-decode", "bad-opset", "missing-text",
                                  "opset-only-without-onnx"])
def test_bad_input_is_one_red_line_and_exit_code_2(case, runner, trained_run, no_predictor_run, tmp_path):
    out = tmp_path / "bundle"
    args = ["export", str(trained_run), "--out", str(out)]
    if case == "not-a-checkpoint":
        (tmp_path / "empty").mkdir()
        args[1] = str(tmp_path / "empty")
    elif case == "no-predictor":
        args += ["--routing", "predictor"]
        args[1] = str(no_predictor_run)
    elif case == "bfloat16-onnx":
        args += ["--dtype", "bfloat16"]
    elif case == "bad-dtype":
        args += ["--dtype", "float64"]
    elif case == "bad-provider":
        args += ["--provider", "tpu"]
    elif case == "cuda-provider":
        from modcli.bundle.validation import cuda_provider_works

        if cuda_provider_works():
            pytest.skip("onnxruntime's CUDA provider works here")
        args += ["--provider", "cuda"]
    elif case in ("out-exists", "force-on-a-foreign-folder"):
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
        if case == "force-on-a-foreign-folder":
            args.append("--force")
    elif case == "nothing-to-export":
        args += ["--no-onnx"]
    elif case == "opset-only-without-onnx":
        args += ["--no-onnx", "--compile", "--opset-only"]
    elif case == "bad-graph":
        args += ["--graph", "prefill"]
    elif case == "topk-decode":
        args += ["--routing", "topk"]
    elif case == "bad-opset":
        args += ["--opset", "13"]
    elif case == "missing-text":
        args += ["--text", str(tmp_path / "nope.txt")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and "Traceback" not in result.output
    if case in ("out-exists", "force-on-a-foreign-folder"):
        assert (out / "notes.txt").read_text() == "keep me" and len(list(out.iterdir())) == 1
    else:
        assert not out.exists()
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.slow
def test_exported_decode_graph_gathers_few_rows_and_equals_eager_decoding_on_both_sides_of_the_cap(tmp_path):
    """Batch 6 through the fused ONNX decode graph: a routed block computes only the processing rows (gathered into
    the export's row cap) when at most that many process the token, all rows otherwise; steps of both kinds occur
    here and every step's logits and stored rows equal eager decoding."""
    import onnxruntime as ort
    from modcli_runtime.cache import CacheSpec

    from modcli.bundle.fusion import fuse_graph
    from modcli.bundle.lowering import MIN_OPSET, decode_spec, export_onnx, export_program
    from modcli.decode.graphs import EXPORT_ROW_CAP_BATCH, row_cap_for

    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config()).eval()
    with torch.no_grad():  # about half the rows process each token: counts on both sides of the cap
        for block in model.blocks:
            if block.router is not None:
                block.router.score.bias.fill_(0.0)
    config = model.config
    cap = row_cap_for(EXPORT_ROW_CAP_BATCH, config.capacity)
    batch, prompt, steps = 6, 7, 12
    assert cap < batch
    spec = decode_spec(model, "router")
    path = tmp_path / "decode.onnx"
    export_onnx(spec, export_program(spec), path, MIN_OPSET)
    fuse_graph(path, config.n_heads, config.d_model)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cache_spec = CacheSpec(n_layers=config.n_layers, n_heads=config.kv_heads, head_dim=config.head_dim,
                           dtype="float32", routed_layers=config.routed_layers(),
                           capacity=config.capacity_fraction(),
                           processed_row_layers=[layer for layer in range(config.n_layers)
                                                 if config.attention_is_routed(layer)])
    tokens = torch.randint(0, config.vocab_size, (batch, prompt + steps), generator=torch.Generator().manual_seed(2))
    cache = DecoderCache.allocate(config, batch, prompt + steps, torch.device("cpu"))
    feeds = cache_spec.allocate(batch, prompt + steps)
    counts = []
    with torch.no_grad():
        for t in range(prompt + steps):  # every token through both step functions, teacher-forced
            eager = model.decode_step(tokens[:, t], cache, "router")
            feeds["tokens"], feeds["positions"] = tokens[:, t].numpy(), np.full(batch, t)
            outputs = dict(zip(spec.output_names, session.run(spec.output_names, feeds), strict=True))
            cache_spec.write_rows(feeds, outputs)
            np.testing.assert_allclose(outputs["logits"], eager.numpy(), atol=ATOL, rtol=0)
            counts += [int(outputs[f"processed.{layer}"].sum()) for layer in config.routed_layers()]
    assert min(counts) <= cap < max(counts)
    for layer in range(config.n_layers):
        assert feeds[f"lengths.{layer}"].tolist() == cache.layers[layer].lengths.tolist()
