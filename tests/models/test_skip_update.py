"""--skip-update linear: a routed block's skipped tokens get a low-rank forecast x + U(D(x)) instead of nothing.
At init it is the identity path; with weights, the skipped tokens are checked by hand, cached decoding against the
causal full forward, the static decode step against eager, FLOP counts, conversion and the refusals."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder, config_rope
from modcli.models.flops import decode_step_flops, flops
from tests.conftest import tiny_model_config
from tests.models.decoding_checks import assert_cached_decoding_equals_forward, assert_static_step_equals_eager

CPU = torch.device("cpu")
ATOL = 1e-5


def _model(skip: str = "linear", random_forecast: bool = True, **overrides) -> MoDDecoder:
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(skip_update=skip, skip_rank=4, **overrides)).eval()
    if random_forecast:
        with torch.no_grad():
            for block in model.blocks:
                if block.skip is not None:
                    block.skip.up.weight.normal_(std=0.2)
    return model


@torch.no_grad()
@pytest.mark.parametrize("part", ["block", "attention", "mlp"])
def test_at_init_the_linear_skip_path_is_the_identity_path(part):
    linear = _model(random_forecast=False, route_part=part)
    identity = MoDDecoder(tiny_model_config(route_part=part)).eval()
    identity.load_state_dict(linear.state_dict(), strict=False)
    tokens = torch.randint(0, 256, (2, 16))
    for mode in ("topk", "router", "predictor"):
        torch.testing.assert_close(linear(tokens, mode), identity(tokens, mode), atol=0, rtol=0)
    cache_a = DecoderCache.allocate(linear.config, 2, 20, CPU)
    cache_b = DecoderCache.allocate(identity.config, 2, 20, CPU)
    linear(tokens, "router", cache=cache_a)
    identity(tokens, "router", cache=cache_b)
    following = torch.randint(0, 256, (2,))
    torch.testing.assert_close(linear.decode_step(following, cache_a, "router"),
                               identity.decode_step(following, cache_b, "router"), atol=0, rtol=0)


@torch.no_grad()
def test_skipped_tokens_get_the_forecast_and_processed_ones_the_block():
    model = _model(route_layers=(1,), route_every=0)
    block = model.blocks[1]
    x = torch.randn(2, 16, model.config.d_model)
    cos, sin = config_rope(model.config, torch.arange(16))
    out, record = block(x, cos, sin, "topk")
    processed = torch.zeros(2, 16, dtype=torch.bool).scatter(1, record.selection.selected_idx, True)
    without = MoDDecoder(tiny_model_config(route_layers=(1,), route_every=0)).eval().blocks[1]
    without.load_state_dict(block.state_dict(), strict=False)
    plain, _ = without(x, cos, sin, "topk")
    forecast = x + block.skip.up(block.skip.down(x))
    torch.testing.assert_close(out[processed], plain[processed], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[~processed], forecast[~processed], atol=ATOL, rtol=0)
    assert (plain[~processed] == x[~processed]).all()  # without it the skipped tokens are x itself


@torch.no_grad()
@pytest.mark.parametrize("part", ["block", "attention", "mlp"])
@pytest.mark.parametrize("mode", ["router", "predictor"])
def test_cached_decoding_equals_the_causal_full_forward(part, mode):
    assert_cached_decoding_equals_forward(_model(route_part=part), mode)


@torch.no_grad()
@pytest.mark.parametrize(("part", "options"), [("block", {}), ("attention", {}), ("mlp", {}),
                                               ("block", {"branch_free": True}), ("block", {"kv": True})])
def test_static_decode_step_equals_eager(part, options):
    model = _model(route_part=part, keep_skipped_kv=options.get("kv", False))
    assert_static_step_equals_eager(model, branch_free=options.get("branch_free", False))


def test_flops_count_the_forecast_of_every_token():
    linear, identity = tiny_model_config(skip_update="linear", skip_rank=4), tiny_model_config()
    routed = len(identity.routed_layers())
    extra = 2 * 2 * identity.d_model * 4
    assert flops(linear, 32).router - flops(identity, 32).router == routed * 32 * extra
    work = {layer: (3, 10) for layer in range(identity.n_layers)}
    assert (decode_step_flops(linear, 3, work).router - decode_step_flops(identity, 3, work).router
            == routed * 3 * extra)


def test_convert_with_a_linear_skip_starts_at_the_dense_model_and_trains_it(trained_dense_run, corpus_file,
                                                                           tmp_path):
    runner = CliRunner()
    out = tmp_path / "skip"
    result = runner.invoke(app, ["train", "--init-from", str(trained_dense_run), "--data", str(corpus_file),
                                 "--skip-update", "linear", "--skip-rank", "4", "--capacity", "0.5",
                                 "--trainable", "routers", "--max-steps", "2", "--batch-size", "2",
                                 "--eval-batches", "1", "--out", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    from modcli.checkpoint.store import load_model

    model = load_model(out)
    ups = [block.skip.up.weight for block in model.blocks if block.skip is not None]
    assert ups and all(up.abs().sum() > 0 for up in ups)  # --trainable routers trains the forecast too


@pytest.mark.parametrize(("overrides", "says"), [
    (dict(skip_update="affine"), "--skip-update must be one of identity, linear"),
    (dict(skip_update="linear", skip_rank=0), "--skip-rank must be >= 1"),
    (dict(skip_update="linear", arch="early-exit"), "--skip-update is a Mixture-of-Depths option"),
])
def test_refusals(overrides, says):
    with pytest.raises(UserError, match=says):
        ModelConfig.of(d_model=32, n_layers=4, n_heads=4, seq_len=32, **overrides)


@pytest.mark.slow
def test_a_linear_skip_exports_and_validates(tmp_path):
    """ONNX (prefill and decode graphs) against eager PyTorch; the decode graph through modcli-run is checked by
    tests/runtime/test_runtime.py ("skip-linear") and the Hugging Face folder by tests/bundle/test_hf_export.py."""
    from modcli.bundle.writer import ExportConfig, export
    from tests.bundle.test_export import random_checkpoint

    checkpoint = random_checkpoint(tmp_path / "run", skip_update="linear", skip_rank=4)
    result = export(ExportConfig(checkpoint=str(checkpoint), out=str(tmp_path / "bundle"), provider="cpu"))
    assert result.valid, result.failures
