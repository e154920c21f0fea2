"""--route-part per block ("attention:1,mlp:3"): the named blocks are routed, each skipping its own part. Parsing and
refusals, each block against a model routing that part alone, cached decoding against the full forward, the static
decode step against eager, and FLOP counts."""

from __future__ import annotations

import pytest
import torch

from modcli.errors import UserError
from modcli.models.decoder import MoDDecoder, config_rope
from modcli.models.flops import flops
from tests.conftest import tiny_model_config
from tests.models.decoding_checks import assert_cached_decoding_equals_forward, assert_static_step_equals_eager


def test_parsing_names_the_routed_blocks_and_is_canonical():
    config = tiny_model_config(route_part="mlp:3, attention:1")
    assert config.route_part == "attention:1,mlp:3" and config.routed_layers() == [1, 3]
    assert [config.route_part_at(layer) for layer in (1, 3)] == ["attention", "mlp"]
    assert config.attention_is_routed(1) and not config.mlp_is_routed(1)
    assert config.mlp_is_routed(3) and not config.attention_is_routed(3) and not config.kv_is_routed(3)
    assert tiny_model_config(route_part="block:0,2-3").routed_layers() == [0, 2, 3]
    assert tiny_model_config(route_part="attention").route_part_at(1) == "attention"  # one part for all


@pytest.mark.parametrize(("overrides", "says"), [
    (dict(route_part="everything:1"), "--route-part: unknown part 'everything'"),
    (dict(route_part="attention:1,mlp:1"), "block 1 is named twice"),
    (dict(route_part="attention:1-7"), "out of range"),
    (dict(route_part="attention:1", route_layers=(1, 3)), "give one of them"),
    (dict(route_part="attention:1,mlp:3", keep_skipped_kv=True), "--keep-skipped-kv"),
    (dict(route_part="attention:1", drop="mlp:1"), "dropped or routed"),
    (dict(route_part="sideways"), "--route-part must be one of block, attention, mlp or PART:BLOCKS"),
])
def test_refusals(overrides, says):
    with pytest.raises(UserError, match=says):
        tiny_model_config(**overrides)


def _model(**overrides) -> MoDDecoder:
    torch.manual_seed(0)
    return MoDDecoder(tiny_model_config(route_part="attention:1,mlp:3", **overrides)).eval()


@torch.no_grad()
def test_each_block_routes_its_own_part():
    model = _model()
    x = torch.randn(2, 16, model.config.d_model)
    cos, sin = config_rope(model.config, torch.arange(16))
    for layer, part in ((1, "attention"), (3, "mlp")):
        alone = MoDDecoder(tiny_model_config(route_part=part, route_layers=(layer,))).eval()
        alone.load_state_dict(model.state_dict(), strict=False)
        mine, _ = model.blocks[layer](x, cos, sin, "topk")
        theirs, _ = alone.blocks[layer](x, cos, sin, "topk")
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["router", "predictor"])
def test_cached_decoding_equals_the_causal_full_forward(mode):
    cache = assert_cached_decoding_equals_forward(_model(), mode)
    assert cache.layers[3].lengths.tolist() == [14, 14, 14]  # an MLP-routed block caches every token


@torch.no_grad()
@pytest.mark.parametrize("branch_free", [False, True])
def test_static_decode_step_equals_eager(branch_free):
    assert_static_step_equals_eager(_model(), branch_free=branch_free)


def test_flops_route_each_blocks_own_part():
    mixed = flops(tiny_model_config(route_part="attention:1,mlp:3"), 32)
    attention = flops(tiny_model_config(route_part="attention", route_layers=(1,)), 32)
    mlp = flops(tiny_model_config(route_part="mlp", route_layers=(3,)), 32)
    dense = flops(tiny_model_config(route_every=0), 32)
    assert mixed.attention_proj == attention.attention_proj and mixed.mlp == mlp.mlp
    assert mixed.attention_proj < dense.attention_proj and mixed.mlp < dense.mlp
