"""`modcli profile`: the command on a tiny config, FLOP counts, and each bad-input path. No timed assertions."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from modcli import packed_linear
from modcli.cli import app
from modcli.errors import UserError
from modcli.models.decoder import MoDDecoder
from modcli.profiling.profile import ProfileConfig, profile
from modcli.profiling.report import tables
from tests.conftest import tiny_model_config

runner = CliRunner()

TINY_FLAGS = ["--preset", "tiny", "--d-model", "32", "--n-layers", "4", "--n-heads", "4", "--capacity", "0.25",
              "--predictor-hidden", "16", "--batch-size", "2", "--repeats", "2", "--warmup", "0",
              "--decode-tokens", "4", "--device", "cpu"]
STATISTICS = {"latency_ms", "latency_min_ms", "latency_max_ms", "tokens_per_s"}
"""What every timing reports, eager, compiled, onnxruntime and --onnx alike (modcli_runtime.timing.latency_stats)."""
TIMING_FIELDS = STATISTICS | {"peak_mem_bytes", "compile_s", "graph_breaks"}


def invoke(*args: str):
    return runner.invoke(app, ["profile", *args])


def rendered(result) -> str:
    """The text of every table `modcli profile` prints for `result`."""
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    for table in tables(result):
        console.print(table)
    return console.export_text()


@pytest.mark.slow
def test_json_holds_every_field():
    result = invoke(*TINY_FLAGS, "--seq-len", "32", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)  # exactly one JSON object on stdout; progress went to stderr
    assert "forward" in result.stderr
    assert payload["device"] == "cpu" and payload["device_name"].startswith("CPU")
    assert payload["linear_kernel"] == packed_linear.linear_kernel(torch.device("cpu"), "float32", None)
    assert payload["model"]["routed_layers"] == [1, 3] and payload["baseline"]["dense"]
    assert payload["model"]["routers_calibrated"]
    (row,) = payload["results"]
    assert row["seq_len"] == 32
    for side in ("model", "baseline"):
        measured = row[side]
        for count in ("forward_flops_per_seq", "train_flops_per_seq", "forward_flops_counted_per_seq",
                      "prefill_flops_counted_per_seq", "decode_flops_counted_per_token", "kv_cache_bytes",
                      "kv_cache_dense_bytes"):
            assert measured[count] > 0, count
        for name in ("forward", "train_step", "prefill", "decode"):
            timing = measured[name]
            assert set(timing) == TIMING_FIELDS
            assert timing["latency_min_ms"] <= timing["latency_ms"] <= timing["latency_max_ms"]
            assert timing["tokens_per_s"] > 0 and timing["peak_mem_bytes"] > 0
            assert timing["compile_s"] is None
    assert set(row["model"]["processed_fraction"]) == {"block1", "block3"}
    assert row["baseline"]["processed_fraction"] == {}
    for key in ("forward_flops", "train_flops", "forward_latency", "train_step_latency", "prefill_latency",
                "decode_latency", "forward_peak_mem", "train_step_peak_mem", "decode_peak_mem", "kv_cache"):
        assert key in row["ratio"], key
    for key in ("forward_latency", "train_step_latency", "prefill_latency", "decode_latency"):
        assert row["ratio"][key]["measured"] > 0 and 0 < row["ratio"][key]["ideal"] < 1
    assert row["ratio"]["kv_cache"]["measured"] < 1  # routed blocks cache only what they processed
    assert row["model"]["kv_cache_bytes"] < row["model"]["kv_cache_dense_bytes"]
    for side in ("model", "baseline"):
        measured = row[side]
        assert measured["kv_cache_allocated_bytes"] >= measured["kv_cache_bytes"]
        assert measured["kv_cache_dense_allocated_bytes"] >= measured["kv_cache_dense_bytes"]
        assert measured["train_flops_counted_per_seq"] == measured["train_flops_per_seq"]
    assert row["baseline"]["kv_cache_allocated_bytes"] == row["baseline"]["kv_cache_dense_allocated_bytes"]
    assert 0 < row["ratio"]["kv_cache_allocated"]["measured"] <= 1


@pytest.mark.slow
def test_table_sweep_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "profile.png"
    result = invoke(*TINY_FLAGS, "--seq-lens", "16,32", "--no-memory", "--measure", "forward,train",
                    "--plot", str(plot))
    assert result.exit_code == 0, result.stderr
    for text in ("T = 16", "T = 32", "ratio", "ideal (FLOPs)", "forward latency ms", "training step latency ms",
                 "(calibrated)", "calibrated at T = 16"):
        assert text in result.stdout
    assert "peak memory MiB" not in result.stdout and "decode step" not in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_profile_counts_forward_training_and_decode_flops_like_the_analytic_formulas():
    from modcli.models.flops import decode_step_flops

    batch, seq_len, steps = 2, 24, 3
    result = profile(ProfileConfig(model=tiny_model_config(), seq_lens=[seq_len], batch_size=batch, repeats=1,
                                   warmup=0, decode_tokens=steps, memory=False, device="cpu"), quiet=True)
    row = result.results[0]
    for side in (row.model, row.baseline):
        assert side.forward_flops_counted_per_seq == side.forward_flops_per_seq
        assert side.train_flops_counted_per_seq == side.train_flops_per_seq
    # The dense twin's decode steps are known in advance: every row, every layer, T + step + 1 slots.
    config = tiny_model_config().dense_twin()
    total = sum(decode_step_flops(config, batch, {layer: (batch, seq_len + step + 1)
                                                  for layer in range(config.n_layers)}).total for step in range(steps))
    assert row.baseline.decode_flops_counted_per_token == total // (batch * steps)  # attention included
    assert row.ratio["forward_flops"].measured == pytest.approx(row.ratio["forward_flops"].ideal)
    assert row.ratio["train_flops"].measured == pytest.approx(row.ratio["train_flops"].ideal)
    text = rendered(result)
    for label in ("forward latency ms", "training step latency ms", "prefill (router) latency ms",
                  "decode step latency ms", "decode FLOPs/token (counted)", "KV cache MiB stored (24+3 tokens)"):
        assert label in text
    decode = row.model.decode
    assert f"{decode.latency_ms:.2f} ({decode.latency_min_ms:.2f}-{decode.latency_max_ms:.2f})" in text
    assert "speed, T" not in text and "onnxruntime" not in text  # eager only, no --onnx bundle


@pytest.mark.slow
@torch.no_grad()
def test_fresh_routers_are_calibrated_with_the_causal_rule_at_each_length():
    from modcli.profiling.calls import input_tokens
    from modcli.profiling.subjects import CALIBRATION_ROWS, CALIBRATION_SEED_OFFSET, calibrate_routers

    config = ProfileConfig(model=tiny_model_config(capacity=0.25), device="cpu", routing="router")
    model = MoDDecoder(config.model).eval()
    for seq_len in (32, 64):
        calibrate_routers(model, config, torch.device("cpu"), seq_len)
        tokens = input_tokens(model.config, CALIBRATION_ROWS, seq_len, config.seed + CALIBRATION_SEED_OFFSET,
                              torch.device("cpu"))
        _, aux = model(tokens, "router", return_aux=True)  # causal: each block sees the blocks before it
        records = aux.records
        for record in records:
            share = record.selection.counts.sum().item() / tokens.numel()
            assert abs(share - 0.25) <= 1 / tokens.numel(), (seq_len, record.layer, share)
    result = profile(ProfileConfig(model=tiny_model_config(capacity=0.25), seq_lens=[32, 64], batch_size=2,
                                   repeats=1, warmup=0, measure=["decode"], decode_tokens=2, memory=False,
                                   device="cpu"), quiet=True)
    assert result.model.routers_calibrated
    for row in result.results:  # other tokens than the calibration ones: near the capacity, not equal to it
        assert all(0.1 < share < 0.45 for share in row.model.processed_fraction.values()), row.model.processed_fraction


@pytest.mark.slow
def test_checkpoint_against_another_checkpoint(trained_run, trained_dense_run):
    result = invoke(str(trained_run), "--compare", str(trained_dense_run), "--seq-len", "32", "--batch-size", "2",
                    "--repeats", "1", "--warmup", "0", "--decode-tokens", "4", "--measure", "forward,decode",
                    "--routing", "predictor", "--no-memory", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["model"]["source"].endswith("step-00000030") and not payload["model"]["routers_calibrated"]
    assert payload["baseline"]["source"].endswith("step-00000010") and payload["baseline"]["dense"]
    assert payload["routing"] == "predictor"
    row = payload["results"][0]
    assert row["model"]["decode"]["latency_ms"] > 0 and row["baseline"]["decode"]["latency_ms"] > 0
    assert row["ratio"]["kv_cache"]["measured"] < 1


@pytest.mark.parametrize("args, message", [
    (["/no/such/run"], "no such checkpoint or run folder"),
    (["--compare", "/no/such/run", "--seq-len", "16"], "--compare: no such checkpoint"),
    (["--d-model", "30", "--n-heads", "4"], "--d-model (30) must be divisible by --n-heads (4)"),
    (["--seq-len", "1"], "--seq-len must be >= 2, got 1"),
    (["--seq-lens", "64,1"], "--seq-len must be >= 2, got 1"),
    (["--seq-lens", "64,x"], "--seq-lens must be comma-separated integers"),
    (["--seq-len", "64", "--seq-lens", "64,128"], "not both"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--measure", "forward,speed"], "--measure must be among"),
    (["--routing", "topk"], "topk is not causal: it sees the future"),
    (["--router", "sideways"], "--router must be one of topk, random, threshold"),
    (["--threshold", "0.3"], "--threshold is an option of --router threshold, not of --router topk"),
    (["--dtype", "float64"], "--dtype must be one of"),
    (["--capacity", "1.5"], "--capacity must be in (0, 1], got 1.5"),
    (["--plot", "out.jpg"], "--plot must name a .png file"),
    (["--preset", "huge"], "--preset must be one of"),
])
def test_bad_input_is_one_red_line_and_exit_2(args, message):
    result = invoke(*args, "--device", "cpu")
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_flags_with_a_checkpoint_are_refused(trained_run):
    result = invoke(str(trained_run), "--d-model", "64", "--device", "cpu")
    assert result.exit_code == 2
    assert "do not combine them with a checkpoint" in result.stderr


def test_dense_model_against_dense_is_refused():
    with pytest.raises(UserError, match="already dense"):
        profile(ProfileConfig(model=tiny_model_config().dense_twin(), seq_lens=[16], device="cpu", memory=False),
                quiet=True)


def test_predictor_routing_needs_a_predictor():
    with pytest.raises(UserError, match="--routing predictor"):
        profile(ProfileConfig(model=tiny_model_config(predictor_hidden=0), routing="predictor", seq_lens=[16],
                              device="cpu", memory=False), quiet=True)


def test_plot_without_matplotlib_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(UserError, match="--plot needs matplotlib"):
        profile(ProfileConfig(model=tiny_model_config(), plot="x.png", device="cpu"), quiet=True)


@pytest.mark.slow
def test_onnx_bundles_are_timed_beside_eager(trained_run, tmp_path_factory):
    from tests.bundle.test_export import exported_bundle

    bundle = exported_bundle(trained_run, tmp_path_factory.mktemp("bundles"))
    result = invoke(str(trained_run), "--compare", "none", "--onnx", str(bundle), "--seq-len", "16",
                    "--batch-size", "2", "--measure", "forward", "--repeats", "2", "--warmup", "0", "--no-memory",
                    "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["onnx"]
    assert entry["seq_len"] == 16 and entry["provider"] == "CPUExecutionProvider"
    for graph in ("forward", "decode"):  # the eager timings' statistics, by the same definitions
        timing = entry[graph]
        assert STATISTICS <= set(timing) and not {"min_ms", "p90_ms"} & set(timing)
        assert 0 < timing["latency_min_ms"] <= timing["latency_ms"] <= timing["latency_max_ms"]
    assert entry["forward"]["tokens_per_s"] == pytest.approx(2 * 16 / (entry["forward"]["latency_ms"] / 1e3))
    assert entry["decode"]["tokens_per_s"] == pytest.approx(2 / (entry["decode"]["latency_ms"] / 1e3))

    profiled = profile(ProfileConfig(checkpoint=str(trained_run), compare="none", onnx=[str(bundle), str(bundle)],
                                     seq_lens=[16], batch_size=1, measure=["forward"], repeats=2, warmup=0,
                                     memory=False, device="cpu"), quiet=True)
    text = rendered(profiled)
    assert "onnxruntime, batch 1: median (min-max) ms of 2 calls" in text and str(bundle) in text
    first = profiled.onnx[0]["decode"]
    assert f"{first['latency_ms']:.2f} ({first['latency_min_ms']:.2f}-{first['latency_max_ms']:.2f})" in text
    assert text.count("1.000") >= 2  # the first bundle against itself, forward and decode


def test_onnx_flag_needs_a_bundle(tmp_path):
    result = invoke(*TINY_FLAGS, "--seq-len", "16", "--onnx", str(tmp_path), "--no-memory", "--measure", "forward")
    assert result.exit_code == 2 and "not a modcli export bundle" in result.stderr
