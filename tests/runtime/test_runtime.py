"""The PyTorch-free runtime in export/: same greedy text as `modcli generate`, with torch blocked from import."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.bundle.test_export import ATOL, exported_bundle, random_checkpoint
from tests.conftest import make_corpus_text

EXPORT_DIR = Path(__file__).resolve().parents[2] / "export"

# Runs modcli_runtime's command line in a fresh interpreter where `import torch` (and modcli, the training
# package) raise ImportError, then checks that neither was loaded.
NO_TORCH_BOOTSTRAP = """
import importlib.abc, runpy, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "modcli"):
            raise ImportError(f"{name} is blocked: the runtime must not need it")
        return None

sys.meta_path.insert(0, NoTorch())
sys.argv = ["modcli-run", *sys.argv[1:]]
try:
    runpy.run_module("modcli_runtime", run_name="__main__")
finally:
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "modcli"))
    if leaked:
        print(f"leaked imports: {leaked}", file=sys.stderr)
        sys.exit(3)
"""


@pytest.fixture(scope="module")
def bundle(trained_run, tmp_path_factory) -> Path:
    return exported_bundle(trained_run, tmp_path_factory.mktemp("bundles"))


def run_without_torch(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXPORT_DIR), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", NO_TORCH_BOOTSTRAP, *args], capture_output=True, text=True,
                          env=env, timeout=120)


def modcli_generate(run: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    from modcli.decode.generation import GenerateConfig, generate

    config = GenerateConfig(checkpoint=str(run), prompts=prompts, max_new_tokens=max_new_tokens, temperature=0,
                            device="cpu")
    return generate(config).texts


@pytest.mark.slow
def test_runtime_without_torch_generates_the_same_greedy_text_as_modcli_generate(bundle, trained_run):
    prompts = ["def f_3(x):\n    return", "x = "]
    expected = modcli_generate(trained_run, prompts, 40)
    result = run_without_torch(str(bundle), "--prompt", prompts[0], "--prompt", prompts[1], "--temperature", "0",
                               "--max-new-tokens", "40", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["texts"] == expected
    assert payload["provider"] == "CPUExecutionProvider"
    assert set(payload["processed_fraction"]) == {"block1", "block3"}


@pytest.mark.slow
def test_runtime_samples_the_same_text_as_modcli_generate_for_the_same_seed(bundle, trained_run):
    """temperature 0.8, top-p 0.95: the same uniforms drive the same inverse-CDF rule on both sides."""
    from modcli_runtime import load_bundle

    from modcli.decode.generation import GenerateConfig, generate

    options = dict(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=2024)
    one = ["def f_3(x):\n    return"]
    two = ["def f_3(x):\n    return", "x = "]  # different lengths: row 1 samples its i-th token at another step
    streamed: list[bytes] = []
    expected_one = generate(GenerateConfig(checkpoint=str(trained_run), prompts=one, device="cpu", **options),
                            on_bytes=lambda row, data: streamed.append(data)).texts
    expected_two = generate(GenerateConfig(checkpoint=str(trained_run), prompts=two, device="cpu", **options)).texts
    assert b"".join(streamed).decode("utf-8", errors="replace") == expected_one[0]
    assert expected_two != modcli_generate(trained_run, two, 40)  # really sampled, not greedy

    assert load_bundle(bundle).generate(one, **options).texts == expected_one
    result = run_without_torch(str(bundle), "--prompt", two[0], "--prompt", two[1], "--temperature", "0.8",
                               "--top-p", "0.95", "--seed", "2024", "--max-new-tokens", "40", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["texts"] == expected_two


@pytest.mark.slow
def test_runtime_streams_one_prompt_to_stdout(bundle, trained_run):
    expected = modcli_generate(trained_run, ["def "], 24)[0]
    result = run_without_torch(str(bundle), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "def " + expected + "\n"
    assert "tokens/s" in result.stderr and "processed block1=" in result.stderr


@pytest.mark.slow
def test_python_api_greedy_sampling_and_streaming(bundle, trained_run):
    from modcli_runtime import load_bundle

    runtime = load_bundle(bundle)
    streamed: list[tuple[int, int]] = []
    greedy = runtime.generate(["class "], max_new_tokens=12, temperature=0,
                              on_token=lambda row, token: streamed.append((row, token)))
    assert greedy.texts == modcli_generate(trained_run, ["class "], 12)
    assert [token for _, token in streamed] == greedy.tokens[0]
    assert runtime.generate(["class "], max_new_tokens=12, temperature=1.0, top_k=1).tokens == greedy.tokens
    sampled = [runtime.generate(["class "], max_new_tokens=12, temperature=1.0, top_k=20, seed=5).tokens
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded
    assert runtime.generate(["class "], max_new_tokens=12, temperature=1.0, top_p=1e-6).tokens == greedy.tokens


def test_sampling_rules():
    from modcli_runtime import sample

    rng = np.random.default_rng(0)  # a Generator in place of the uniforms draws them
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.9]], dtype=np.float32)
    assert sample(logits, 0.0, 0, 1.0, rng).tolist() == [1, 0]
    assert sample(logits, 2.0, 1, 1.0, rng).tolist() == [1, 0]
    draws = np.stack([sample(logits, 1.0, 2, 1.0, rng) for _ in range(200)])
    assert set(draws[:, 0]) <= {1, 3} and set(draws[:, 1]) == {0, 3}


@pytest.mark.slow
def test_runtime_refuses_damaged_or_invalid_bundles(bundle, tmp_path):
    from modcli_runtime import BundleError, load_bundle

    damaged = tmp_path / "damaged"
    shutil.copytree(bundle, damaged)
    data = bytearray((damaged / "decode.onnx").read_bytes())
    data[-1] ^= 0xFF
    (damaged / "decode.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256"):
        load_bundle(damaged)

    invalid = tmp_path / "invalid"
    shutil.copytree(bundle, invalid)
    manifest = json.loads((invalid / "manifest.json").read_text())
    (invalid / "manifest.json").write_text(json.dumps({**manifest, "valid": False}))
    with pytest.raises(BundleError, match="failed validation"):
        load_bundle(invalid)
    assert load_bundle(invalid, allow_invalid=True).generate(["a"], max_new_tokens=2, temperature=0).steps == 2

    unreadable = tmp_path / "unreadable-tokenizer"
    shutil.copytree(bundle, unreadable)
    manifest = json.loads((unreadable / "manifest.json").read_text())
    manifest["model"]["tokenizer"] = "tokenizer.json"
    (unreadable / "manifest.json").write_text(json.dumps(manifest))
    (unreadable / "tokenizer.json").write_text("{}")
    with pytest.raises(BundleError, match="tokenizer.json: not a readable tokenizer.json"):
        load_bundle(unreadable, verify=False)

    result = run_without_torch(str(tmp_path / "nowhere"), "--prompt", "x")
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    result = run_without_torch(str(invalid), "--prompt", "x")
    assert result.returncode == 2 and "--allow-invalid" in result.stderr
    result = run_without_torch(str(unreadable), "--no-verify", "--prompt", "x")
    assert result.returncode == 2 and "not a readable tokenizer.json" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_time_bundle_reports_latencies_for_profile(bundle):
    from modcli.bundle.writer import time_bundle

    timings = time_bundle(bundle, batch=2, seq_len=16, cache_tokens=24, repeats=3, warmup=1)
    assert timings["provider"] == "CPUExecutionProvider"
    assert timings["forward"]["latency_ms"] > 0 and timings["forward"]["seq_len"] == 16
    assert timings["decode"]["latency_ms"] > 0 and timings["decode"]["batch"] == 2
    assert set(timings["decode"]["calls_with_block_work"]) == {"block1", "block3"}
    assert timings["decode"]["routed_cache_tokens"] == 6  # the top-k share (capacity 1/4) of 24 by default
    timings = time_bundle(bundle, seq_len=4, cache_tokens=8, routed_cache_tokens=300, repeats=2, warmup=0)
    assert timings["decode"]["cache_tokens"] == 8 and timings["decode"]["routed_cache_tokens"] == 300


# ----------------------------------------------------------------------------------------------- the KV cache


@pytest.mark.parametrize("batch", [3, 6])  # a few rows are written one by one, more with advanced indexing
def test_cache_spec_writes_rows_in_place_and_grows_by_doubling(batch):
    from modcli_runtime import CacheSpec

    spec = CacheSpec(n_layers=2, n_heads=2, head_dim=3, dtype="float32", routed_layers=[1], capacity=(1, 8),
                     processed_row_layers=[1])
    feeds = spec.allocate(batch=batch, max_tokens=200)
    assert feeds["keys.0"].shape == (batch, 2, 200, 3) and feeds["keys.1"].shape == (batch, 2, 50, 3)
    dense_buffer = feeds["keys.0"]
    rng = np.random.default_rng(0)
    stored: dict[int, list[list[np.ndarray]]] = {layer: [[] for _ in range(batch)] for layer in range(2)}
    for step in range(60):
        outputs = {f"new_{kind}.{layer}": rng.standard_normal((batch, 2, 1, 3)).astype(np.float32)
                   for layer in range(2) for kind in ("keys", "values")}
        outputs["processed.1"] = np.array([True, step % 3 == 0, False] * (batch // 3))
        spec.write_rows(feeds, outputs)
        for layer in range(2):
            for row in range(batch):
                if layer == 0 or outputs["processed.1"][row]:
                    stored[layer][row].append(outputs[f"new_keys.{layer}"][row, :, 0])
    assert feeds["keys.0"] is dense_buffer  # written in place, never reallocated
    assert feeds["lengths.0"].tolist() == [60] * batch and feeds["lengths.1"].tolist() == [60, 20, 0] * (batch // 3)
    assert feeds["keys.1"].shape[2] == 100  # 50 slots doubled once, when row 0 needed its 51st
    for layer in range(2):
        for row in range(batch):
            kept = feeds[f"lengths.{layer}"][row]
            assert np.array_equal(feeds[f"keys.{layer}"][row, :, :kept].transpose(1, 0, 2),
                                  np.array(stored[layer][row]).reshape(kept, 2, 3))


@pytest.mark.slow
def test_device_cache_writes_rows_in_place_with_cache_write_onnx(bundle):
    """The device-resident cache's writer (ScatterND with its output bound to its input) changes only the written
    rows of the very buffer it was given, growing by doubling like the numpy cache; run here on the CPU provider."""
    from modcli_runtime import load_bundle

    runtime = load_bundle(bundle, device_cache=True)
    _, cache = runtime.decoder()
    numpy_feeds = runtime.cache_spec.allocate(2, 40)
    feeds = cache.allocate(2, 40)
    assert all(feeds[n].shape() == list(numpy_feeds[n].shape) for n in numpy_feeds if not n.startswith("lengths"))
    rng = np.random.default_rng(1)
    for step in range(25):
        outputs = {f"new_{kind}.{layer}": rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
                   for layer in range(4) for kind in ("keys", "values")}
        outputs.update({"processed.1": np.array([True, step % 2 == 0]), "processed.3": np.array([False, True])})
        runtime.cache_spec.write_rows(numpy_feeds, outputs)
        device_outputs = {n: cache.to_device(v) if n.startswith("new_") else v for n, v in outputs.items()}
        buffer = feeds["keys.0"]
        cache.write_rows(feeds, device_outputs)
        assert feeds["keys.0"] is buffer  # the dense layer's buffer was written, not replaced
    for name, array in numpy_feeds.items():
        got = feeds[name] if name.startswith("lengths") else feeds[name].numpy()
        assert np.array_equal(got, array), name
    assert feeds["keys.3"].shape()[2] == 40  # 20 slots doubled once (row 1 wrote 25 rows)

    import onnxruntime as ort

    dense = np.zeros((2, 4, 40, 8), dtype=np.float32)
    feeds["keys.0"] = ort.OrtValue.ortvalue_from_numpy(dense)  # on the CPU an OrtValue over the numpy memory
    feeds["lengths.0"][:] = [3, 7]
    cache.write_rows(feeds, device_outputs)
    assert np.array_equal(dense[0, :, 3], outputs["new_keys.0"][0, :, 0])  # written into that very memory
    assert np.array_equal(dense[1, :, 7], outputs["new_keys.0"][1, :, 0])
    assert np.count_nonzero(dense) == 2 * 4 * 8  # and nowhere else


ROUTERS = {"topk-mlp": dict(route_part="mlp", n_layers=2),
           "threshold-block": dict(router="threshold", predictor_hidden=0, n_layers=2),
           "static-drops": dict(drop="attention:0,mlp:2"),  # blocks 1 and 3 routed; block 0 has no cache
           "kv-kept": dict(keep_skipped_kv=True, n_kv_heads=2, n_layers=2),  # skipped tokens keep their K/V
           "skip-linear": dict(skip_update="linear", skip_rank=4, n_layers=2),  # skipped tokens: x + U(D(x))
           "per-block-parts": dict(route_part="attention:1,mlp:3")}  # block 1 routes attention, block 3 its MLP


@pytest.fixture(scope="module")
def decode_only_bundles(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Untrained checkpoints of other routers / route parts, decode graph only: {case: (checkpoint, bundle)}."""
    from modcli.bundle.writer import ExportConfig, export

    root = tmp_path_factory.mktemp("decode-bundles")
    bundles = {}
    for case, overrides in ROUTERS.items():
        checkpoint = random_checkpoint(root / case, **overrides)
        result = export(ExportConfig(checkpoint=str(checkpoint), out=str(root / f"{case}-bundle"), provider="cpu",
                                     graphs=["decode"], decode_steps=2))
        assert result.valid, result.failures
        bundles[case] = (checkpoint, root / f"{case}-bundle")
    return bundles


@pytest.mark.slow
@pytest.mark.parametrize("case", ["topk-block", "topk-block-device-cache", *ROUTERS])
def test_runtime_decode_equals_eager_generate_with_the_kv_cache(case, bundle, trained_run, decode_only_bundles):
    """The runtime's decode (read-only graph + in-place row writes) = `modcli generate`'s eager prefill and
    decode_step: logits within atol, greedy tokens, processed counts and KV cache lengths per layer, for one prompt
    and for a padded batch of prompts of different lengths. "device-cache": the OrtValue cache written in place by
    cache_write.onnx (what --provider cuda uses), here on the CPU provider."""
    from modcli_runtime import generate_tokens, load_bundle

    from modcli.bundle.validation import eager_generation
    from modcli.checkpoint.store import load_model_from

    checkpoint, folder = (trained_run, bundle) if case.startswith("topk-block") else decode_only_bundles[case]
    model, _, _ = load_model_from(checkpoint)
    routing = model.causal_modes()[0]
    runtime = load_bundle(folder, device_cache=case.endswith("device-cache"))
    step, cache = runtime.decoder()
    assert (cache is runtime.cache_spec) != case.endswith("device-cache")
    text = list(make_corpus_text()[:40].encode())
    noise = np.random.default_rng(5).integers(0, 256, 40).tolist()
    processed_any, skipped_any = False, False
    for prompts in ([text[:17]], [text[3:12], noise[:3], text[20:34]]):
        reference = eager_generation(model, prompts, 10, routing)
        got = generate_tokens(step, cache, prompts, vocab_size=256, max_new_tokens=10, temperature=0,
                              return_logits=True)
        assert got.tokens == reference.tokens
        assert max(float(np.abs(mine - ref).max()) for mine, ref in zip(got.logits, reference.logits, strict=True)) <= ATOL
        assert {layer: got.processed_tokens[layer] for layer in reference.processed} == reference.processed
        assert got.cache_lengths == reference.cache_lengths
        counts = np.array(list(got.processed_tokens.values()))  # (routed layers, B)
        processed_any |= bool((counts > 0).any())
        skipped_any |= bool((counts < np.array(got.fed_tokens)).any())
    assert processed_any and skipped_any  # both branches of the routed blocks ran


@pytest.mark.slow
def test_a_version_1_bundle_runs_its_forward_graph_but_refuses_its_decode_graph(bundle, tmp_path):
    from modcli_runtime import BundleError, load_bundle

    old = tmp_path / "v1"
    shutil.copytree(bundle, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 1
    for key in ("every_row_layers", "processed_row_layers", "update"):
        del manifest["graphs"]["decode"]["cache"][key]
    (old / "manifest.json").write_text(json.dumps(manifest))
    runtime = load_bundle(old)
    logits, _ = runtime.forward(np.zeros((1, 5), dtype=np.int64))
    assert logits.shape == (1, 5, 256)
    with pytest.raises(BundleError, match="re-export it with `modcli export`"):
        runtime.generate(["a"], max_new_tokens=2)
    result = run_without_torch(str(old), "--prompt", "x")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "re-export it with `modcli export`" in result.stderr
