"""`modcli.packed_linear`: oneDNN's prepacked linear for CPU inference equals nn.Linear to rounding, falls back to
nn.Linear's own forward (bit for bit) wherever it does not apply, never reads a stale weight, and leaves the model
as it was on exit. No timed assertions (bench/cpu_linear_kernels.py times it)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from modcli import packed_linear
from modcli.cli import app
from modcli.models.build import build_model
from modcli.models.cache import DecoderCache
from modcli.packed_linear import PackedLinears, inference_linears, linear_kernel, pays
from tests.conftest import on_cpu_of, packed_products, tiny_model_config

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this PyTorch build has no oneDNN")
ATOL, RTOL = 1e-5, 1e-5
"""Another summation order than MKL's: rounding only."""

runner = CliRunner()


def big_linear(bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(512, 512, bias=bias)  # 262k weight elements: packed from 2 rows up (`pays`)


def test_the_packed_product_equals_nn_linear_for_every_input_layout():
    layer = big_linear()
    packed = PackedLinears(layer)
    inputs = {"2-d": torch.randn(8, 512), "3-d": torch.randn(2, 8, 512), "4-d": torch.randn(2, 3, 4, 512),
              "non-contiguous": torch.randn(2, 512, 8).transpose(1, 2)}
    with torch.no_grad():
        for name, x in inputs.items():
            reference = layer(x)
            with packed:
                out = layer(x)
            assert out.shape == reference.shape, name
            assert torch.allclose(out, reference, rtol=RTOL, atol=ATOL), name
    assert packed.packed_count() == 1


@pytest.mark.parametrize("case", ["grad", "single row", "bfloat16 autocast", "small weight"])
def test_where_it_does_not_apply_nn_linear_runs_bit_for_bit(case):
    layer = big_linear() if case != "small weight" else nn.Linear(64, 64)
    x = torch.randn(1 if case == "single row" else 8, layer.in_features)
    packed = PackedLinears(layer)

    def run():
        if case == "grad":
            return layer(x)
        with torch.no_grad():
            if case == "bfloat16 autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return layer(x)
            return layer(x)

    reference = run()
    with packed:
        out = run()
    assert torch.equal(out, reference)
    assert packed.packed_count() == 0  # nothing was packed: the product never took the packed kernel
    if case == "grad":
        out.sum().backward()  # nn.Linear's own forward, so training through it works
        assert layer.weight.grad is not None


def test_a_changed_or_replaced_weight_is_packed_again():
    layer = big_linear(bias=False)
    x = torch.randn(8, 512)
    packed = PackedLinears(layer)
    with torch.no_grad(), packed:
        layer(x)
        layer.weight.mul_(2)  # in place: the version counter moves
        assert torch.allclose(layer(x), x @ layer.weight.T, rtol=RTOL, atol=ATOL)
        layer.weight = nn.Parameter(torch.randn(512, 512) / 512**0.5)  # a new parameter (load_state_dict(assign=True))
        assert torch.allclose(layer(x), x @ layer.weight.T, rtol=RTOL, atol=ATOL)
        layer.weight.data = torch.randn(512, 512) / 512**0.5  # new storage under the same parameter
        assert torch.allclose(layer(x), x @ layer.weight.T, rtol=RTOL, atol=ATOL)


def test_a_subclass_with_its_own_forward_keeps_it():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Doubled(512, 512), big_linear())
    packed = PackedLinears(model)
    assert packed.linears == [model[1]]
    x = torch.randn(8, 512)
    with torch.no_grad():
        reference = model(x)
        with packed:
            assert "forward" not in model[0].__dict__
            assert torch.allclose(model(x), reference, rtol=RTOL, atol=ATOL)


def test_exit_leaves_the_model_as_it_was_and_nesting_is_allowed():
    model = build_model(tiny_model_config())
    packed = PackedLinears(model)
    assert packed.linears and all("forward" not in m.__dict__ for m in packed.linears)
    with packed:
        with packed:
            assert all("forward" in m.__dict__ for m in packed.linears)
        assert all("forward" in m.__dict__ for m in packed.linears)  # the inner exit keeps the outer one's
    assert all("forward" not in m.__dict__ for m in packed.linears)
    with pytest.raises(RuntimeError), packed:
        raise RuntimeError("an error inside")
    assert all("forward" not in m.__dict__ for m in packed.linears)


def test_up_to_rows_installs_only_where_such_products_can_pay():
    small, large = nn.Linear(256, 256), nn.Linear(576, 1536)  # 65k elements: from 32 rows; 885k: from 1 row
    model = nn.Sequential(small, large)
    packed = PackedLinears(model)
    with packed.up_to(1):  # a batch-1 decode step
        assert "forward" not in small.__dict__ and "forward" in large.__dict__
        with packed.up_to():  # every one, restored to the enclosing choice on exit
            assert "forward" in small.__dict__
        assert "forward" not in small.__dict__ and "forward" in large.__dict__
    assert "forward" not in large.__dict__


@pytest.mark.parametrize("dense", [False, True])
def test_the_model_forward_and_cached_decoding_equal_the_aten_ones(dense, monkeypatch):
    monkeypatch.setattr(packed_linear, "min_rows", lambda elements: 1)  # tiny weights: pack every product
    config = tiny_model_config()
    model = build_model(config.dense_twin() if dense else config).eval()
    routing = "dense" if dense else "router"
    tokens = torch.randint(0, config.vocab_size, (2, 24))
    step_tokens = torch.randint(0, config.vocab_size, (2,))

    def run():
        forward = model(tokens, "dense" if dense else "topk")
        cache = DecoderCache.allocate(model.config, 2, 25, torch.device("cpu"), torch.float32)
        prefill = model(tokens, routing, cache=cache)
        step = model.decode_step(step_tokens, cache, routing)
        return forward, prefill, step

    packed = PackedLinears(model)
    with torch.no_grad():
        reference = run()
        with packed:
            out = run()
    assert packed.packed_count() >= 4 * config.n_layers + 1  # every block's four matrices and the head ran packed
    for name, a, b in zip(("forward", "prefill", "decode step"), out, reference, strict=True):
        assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), name


def test_the_cost_rule_follows_the_measured_table():
    assert not pays(1, 256 * 704) and pays(2, 256 * 704) and pays(32, 256 * 704)  # single-row decode stays on MKL
    assert pays(1, 1536 * 576)  # a large weight pays even for one row
    assert not pays(2, 256 * 256) and pays(32, 256 * 256)  # a small weight only for many rows


def test_it_applies_to_float32_on_the_cpu_only(monkeypatch):
    model = build_model(tiny_model_config())
    cpu = torch.device("cpu")
    assert inference_linears(model, cpu, "float32", True).kernel == "onednn-packed"
    assert linear_kernel(cpu, "float32", True) == "onednn-packed"

    def assert_disabled(linears: PackedLinears) -> None:
        assert not linears.enabled and linears.kernel == "aten"
        with linears:  # entering a disabled one changes nothing
            assert all("forward" not in m.__dict__ for m in linears.linears)

    for device, dtype, enabled in ((cpu, "bfloat16", True), (cpu, "float32", False),
                                   (torch.device("cuda"), "float32", True)):
        assert_disabled(inference_linears(model, device, dtype, enabled))
        assert linear_kernel(device, dtype, enabled) == "aten"
    monkeypatch.setattr(packed_linear, "available", lambda: False)  # a PyTorch build without oneDNN
    assert_disabled(inference_linears(model, cpu, "float32", True))


def test_unasked_it_is_on_for_amd_cpus_only(monkeypatch):
    """None (no --packed-linears flag): the packed kernel on AMD CPUs, where MKL is slow, and aten elsewhere."""
    cpu = torch.device("cpu")
    for vendor, kernel in (("AuthenticAMD", "onednn-packed"), ("GenuineIntel", "aten"), ("", "aten")):
        on_cpu_of(monkeypatch, vendor)
        assert linear_kernel(cpu, "float32", None) == kernel, vendor
        assert linear_kernel(cpu, "float32", True) == "onednn-packed"  # asked: on any CPU
        assert linear_kernel(cpu, "float32", False) == "aten"
    on_cpu_of(monkeypatch, "AuthenticAMD")
    assert linear_kernel(torch.device("cuda"), "float32", None) == linear_kernel(cpu, "bfloat16", None) == "aten"


def test_the_cpu_vendor_is_read_from_cpuinfo_or_the_platform():
    from modcli.hardware import vendor_of

    assert vendor_of("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n", "x86_64") == "AuthenticAMD"
    assert vendor_of("processor\t: 0\nvendor_id\t: GenuineIntel\n", "") == "GenuineIntel"
    assert vendor_of(None, "AMD64 Family 25 Model 33 Stepping 0, AuthenticAMD") == "AuthenticAMD"  # Windows
    assert vendor_of(None, "arm") == vendor_of("processor\t: 0\nBogoMIPS\t: 50.00\n", "") == ""  # none named


@pytest.mark.parametrize("flag, vendor, kernel", [
    ([], "AuthenticAMD", "onednn-packed"), ([], "GenuineIntel", "aten"), (["--packed-linears"], "GenuineIntel",
                                                                         "onednn-packed"),
    (["--no-packed-linears"], "AuthenticAMD", "aten")])
def test_generate_reports_its_linear_kernel_and_decodes_the_same_text(trained_run, flag, vendor, kernel, monkeypatch):
    on_cpu_of(monkeypatch, vendor)
    count = packed_products(monkeypatch)
    args = ["generate", str(trained_run), "--prompt", "def f", "--max-new-tokens", "12", "--temperature", "0",
            "--device", "cpu", "--json"]
    result = runner.invoke(app, [*args, *flag])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["linear_kernel"] == kernel
    aten = json.loads(runner.invoke(app, [*args, "--no-packed-linears"]).stdout)
    assert payload["tokens"] == aten["tokens"]  # the tiny run's greedy choices have no near-ties
    assert (count[0] > 0) == (kernel == "onednn-packed")


@pytest.mark.parametrize("flag", [[], ["--no-packed-linears"]])
def test_profile_times_its_eager_calls_with_the_kernel_it_reports(flag, monkeypatch):
    on_cpu_of(monkeypatch, "AuthenticAMD")
    count = packed_products(monkeypatch)
    result = runner.invoke(app, ["profile", "--preset", "tiny", "--d-model", "32", "--n-layers", "2", "--n-heads", "4",
                                 "--batch-size", "1", "--seq-len", "16", "--repeats", "1", "--warmup", "0",
                                 "--decode-tokens", "2", "--measure", "forward,decode", "--no-memory", "--device",
                                 "cpu", "--json", *flag])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["linear_kernel"] == ("aten" if flag else "onednn-packed")
    assert (count[0] > 0) == (not flag)  # the timed eager calls did (or did not) run the packed kernel


def test_eval_losses_equal_with_and_without_the_packed_kernel(trained_run, monkeypatch):
    on_cpu_of(monkeypatch, "AuthenticAMD")
    count = packed_products(monkeypatch)
    args = ["eval", str(trained_run), "--batches", "2", "--batch-size", "2", "--device", "cpu", "--json"]
    packed = json.loads(runner.invoke(app, args).stdout)
    products = count[0]
    aten = json.loads(runner.invoke(app, [*args, "--no-packed-linears"]).stdout)
    assert count[0] == products  # none in the second run
    assert (packed["linear_kernel"], aten["linear_kernel"]) == ("onednn-packed", "aten")
    for a, b in zip(packed["results"], aten["results"], strict=True):
        assert a["routing"] == b["routing"] and a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert count[0] > 0  # and the first run's products did go through the packed kernel
