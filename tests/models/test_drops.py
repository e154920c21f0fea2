"""Static drops (--drop): the flag's parsing and refusals, the dropped model against the whole model with the
sublayers removed by hand, the cache (none for a dropped attention; decode = full forward), FLOP counts, the static
decode graph, and the conversion --init-from --max-steps 0."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import ModelConfig
from modcli.config.drops import format_drops, parse_drops
from modcli.decode.static import StaticDecoder
from modcli.errors import UserError
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder, dropped_weight
from modcli.models.flops import flops
from tests.conftest import tiny_model_config

CPU = torch.device("cpu")


@pytest.mark.parametrize(("text", "parsed", "canonical"), [
    ("attention:25-29,mlp:28", {"attention": (25, 26, 27, 28, 29), "mlp": (28,)}, "attention:25-29,mlp:28"),
    ("mlp:3, attention:1,3-4", {"attention": (1, 3, 4), "mlp": (3,)}, "attention:1,3-4,mlp:3"),
    ("block:2", {"attention": (2,), "mlp": (2,)}, "attention:2,mlp:2"),
    ("", {}, ""),
])
def test_parse_and_canonical_text(text, parsed, canonical):
    assert parse_drops(text, 30) == parsed
    assert format_drops(parse_drops(text, 30)) == canonical


@pytest.mark.parametrize(("text", "says"), [
    ("attention:30", "out of range"),
    ("attention:-1", "not a block"),
    ("attention:5-3", "empty"),
    ("attention:1-4,3", "named twice"),
    ("block:2,attention:2", "named twice"),
    ("attention:0-29", "every block"),
    ("heads:1", "unknown part"),
    ("3", "names no part"),
    ("attention:x", "not a block"),
])
def test_bad_drops_are_one_line(text, says):
    with pytest.raises(UserError, match=says):
        parse_drops(text, 30)


def test_config_refusals():
    with pytest.raises(UserError, match="also in --route-layers"):
        tiny_model_config(route_layers=[1], drop="attention:1")
    with pytest.raises(UserError, match="cannot drop"):
        ModelConfig(n_layers=4, arch="early-exit", drop="attention:1")
    with pytest.raises(UserError, match="reads the attention of block 0"):
        tiny_model_config(router="attention", drop="attention:0", predictor_hidden=16)
    # the --route-every pattern passes over a block with a drop
    config = tiny_model_config(route_every=2, route_offset=1, drop="mlp:1")
    assert config.routed_layers() == [3] and config.drop == "mlp:1"
    assert "dropped mlp:1" in config.kind
    assert config.dense_twin().drop == ""


def _remove_by_hand(model: MoDDecoder, config: ModelConfig) -> None:
    """The whole model with each dropped sublayer's update zeroed by a forward hook."""
    for layer, block in enumerate(model.blocks):
        if config.attention_dropped(layer):
            block.attn.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
        if config.mlp_dropped(layer):
            block.mlp.register_forward_hook(lambda module, args, out: torch.zeros_like(out))


@pytest.mark.parametrize("drop", ["attention:1-2", "mlp:0,attention:3", "block:2", "attention:0,mlp:3"])
def test_dropped_model_equals_removing_the_sublayers_by_hand(drop):
    torch.manual_seed(0)
    config = tiny_model_config(route_every=0, drop=drop)
    whole = MoDDecoder(config.dense_twin()).eval()
    dropped = MoDDecoder(config).eval()
    missing, unexpected = dropped.load_state_dict(whole.state_dict(), strict=False)
    assert not missing and unexpected and all(dropped_weight(config, name) for name in unexpected)
    _remove_by_hand(whole, config)
    tokens = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(dropped(tokens), whole(tokens), atol=1e-5, rtol=0)
    assert dropped.num_parameters() < whole.num_parameters()


@pytest.mark.parametrize("route_every", [0, 2])
def test_cache_holds_nothing_for_a_dropped_attention_and_decode_equals_forward(route_every):
    torch.manual_seed(1)
    config = tiny_model_config(route_every=route_every, drop="attention:0,block:2", capacity=1.0)
    model = MoDDecoder(config).eval()
    mode = (model.causal_modes() or ("dense",))[0]
    tokens = torch.randint(0, config.vocab_size, (2, 20))
    cache = DecoderCache.allocate(config, 2, 24, CPU)
    with torch.no_grad():
        model(tokens[:, :16], mode, cache=cache)
        steps = [model.decode_step(tokens[:, i], cache, mode) for i in range(16, 20)]
        full = model(tokens, mode)
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, 16 + i], atol=1e-5, rtol=0)
    assert config.kv_layers() == [1, 3]
    assert cache.layers[0].allocated_bytes() == cache.layers[2].allocated_bytes() == 0
    if not route_every:  # 2 of the 4 layers store K/V (routed ones store what their router chose)
        assert cache.stored_bytes() == cache.dense_equivalent_bytes() * 2 // 4


def test_static_decode_step_equals_eager():
    torch.manual_seed(2)
    config = tiny_model_config(route_every=2, drop="attention:0,mlp:2")
    model = MoDDecoder(config).eval()
    mode = model.causal_modes()[0]
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    static = StaticDecoder(model, 2, 20, mode, CPU, "float32", compile=False)
    cache = DecoderCache.allocate(config, 2, 20, CPU)
    with torch.no_grad():
        static.prefill(tokens)
        model(tokens, mode, cache=cache)
        for token in tokens[:, :4].T:
            torch.testing.assert_close(static.step(token), model.decode_step(token, cache, mode), atol=1e-5, rtol=0)
    names = static._step_module.graph.input_names
    assert "keys.0" not in names and "keys.1" in names and "keys.2" in names  # block 0 has no attention, no cache


def test_flops_count_nothing_for_a_dropped_sublayer():
    config = tiny_model_config(route_every=0, drop="attention:1-2,mlp:3")
    whole = tiny_model_config(route_every=0)
    got, full = flops(config, 32), flops(whole, 32)
    per_block_attention = full.attention_proj // 4
    assert got.attention_proj == full.attention_proj - 2 * per_block_attention
    assert got.attention_scores == full.attention_scores // 2
    assert got.mlp == full.mlp * 3 // 4
    assert got.head == full.head


def test_convert_with_max_steps_0_writes_the_dropped_model(trained_dense_run, tmp_path):
    runner = CliRunner()
    out = tmp_path / "dropped"
    result = runner.invoke(app, ["train", "--init-from", str(trained_dense_run), "--dense", "--drop",
                                 "attention:1-2,mlp:3", "--max-steps", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (checkpoint,) = out.glob("step-*")
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved["model"]["drop"] == "attention:1-2,mlp:3"


@pytest.mark.parametrize(("args", "says"), [
    (["--init-from", "RUN", "--max-steps", "1", "--drop", "attention:9"], "out of range"),
    (["--init-from", "RUN", "--max-steps", "1", "--drop", "attention:0-3"], "every block"),
    (["--max-steps", "0", "--drop", ""], "--max-steps"),  # --max-steps 0 only converts (needs --init-from)
])
def test_bad_conversions_are_one_line_and_write_nothing(trained_dense_run, tmp_path, args, says):
    bad = tmp_path / "bad"
    args = [str(trained_dense_run) if arg == "RUN" else arg for arg in args]
    result = CliRunner().invoke(app, ["train", "--dense", "--out", str(bad), *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert not bad.exists()
