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

from tests.test_export import exported_bundle

EXPORT_DIR = Path(__file__).resolve().parents[1] / "export"

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
    from modcli.generation import GenerateConfig, generate

    config = GenerateConfig(checkpoint=str(run), prompts=prompts, max_new_tokens=max_new_tokens, temperature=0,
                            device="cpu")
    return generate(config).texts


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


def test_runtime_samples_the_same_text_as_modcli_generate_for_the_same_seed(bundle, trained_run):
    """temperature 0.8, top-p 0.95: the same uniforms drive the same inverse-CDF rule on both sides."""
    from modcli_runtime import load_bundle

    from modcli.generation import GenerateConfig, generate

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


def test_runtime_streams_one_prompt_to_stdout(bundle, trained_run):
    expected = modcli_generate(trained_run, ["def "], 24)[0]
    result = run_without_torch(str(bundle), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "def " + expected + "\n"
    assert "tokens/s" in result.stderr and "processed block1=" in result.stderr


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

    result = run_without_torch(str(tmp_path / "nowhere"), "--prompt", "x")
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    result = run_without_torch(str(invalid), "--prompt", "x")
    assert result.returncode == 2 and "--allow-invalid" in result.stderr


def test_time_bundle_reports_latencies_for_profile(bundle):
    from modcli.export_bundle import time_bundle

    timings = time_bundle(bundle, batch=2, seq_len=16, cache_tokens=24, repeats=3, warmup=1)
    assert timings["provider"] == "CPUExecutionProvider"
    assert timings["forward"]["latency_ms"] > 0 and timings["forward"]["seq_len"] == 16
    assert timings["decode"]["latency_ms"] > 0 and timings["decode"]["batch"] == 2
    assert set(timings["decode"]["calls_with_block_work"]) == {"block1", "block3"}
