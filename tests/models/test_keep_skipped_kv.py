"""--keep-skipped-kv: a routed block's skipped tokens still compute and store their keys and values (no query, no
output projection, no MLP), so the processed tokens attend to every earlier token. Checked against a hand-written
reference, the unrouted block at capacity 1.0, cached decoding, the static decode step, the cache, FLOP counts and
the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import ModelConfig
from modcli.decode.static import StaticDecoder
from modcli.errors import UserError
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder, apply_rope, config_rope
from modcli.models.flops import flops
from modcli.models.routing.selection import gather_tokens
from tests.conftest import tiny_model_config

CPU = torch.device("cpu")
ATOL = 1e-5


def _model(**overrides) -> MoDDecoder:
    torch.manual_seed(0)
    values = dict(keep_skipped_kv=True, n_kv_heads=2)
    values.update(overrides)
    return MoDDecoder(tiny_model_config(**values)).eval()


def _reference_block(block, x: torch.Tensor, idx: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The rule by hand, with explicit masked attention: every token's K/V, the selected tokens' queries over the
    keys at or before their position, then output projection, MLP and `x + w * f(x)` for the selected tokens."""
    config, attn = block.config, block.attn
    batch, seq_len, _ = x.shape
    cos, sin = config_rope(config, torch.arange(seq_len))  # (T, hd/2)
    heads = attn.qkv(block.attn_norm(x)).view(batch, seq_len, -1, config.head_dim)  # (B, T, H + 2 Hkv, hd)
    rotated = apply_rope(heads[:, :, :config.n_heads + config.kv_heads], cos[None], sin[None])
    q, k = rotated[:, :, :config.n_heads], rotated[:, :, config.n_heads:]  # (B, T, H, hd), (B, T, Hkv, hd)
    v = heads[:, :, config.n_heads + config.kv_heads:]  # (B, T, Hkv, hd)
    group = config.n_heads // config.kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # (B, T, H, hd)
    q_selected = q.gather(1, idx[:, :, None, None].expand(-1, -1, *q.shape[2:]))  # (B, k, H, hd)
    scores = torch.einsum("bqhd,bthd->bhqt", q_selected, k) / math.sqrt(config.head_dim)  # (B, H, k, T)
    visible = torch.arange(seq_len)[None, None, :] <= idx[:, :, None]  # (B, k, T)
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhqt,bthd->bqhd", probs, v).reshape(batch, idx.shape[1], -1)  # (B, k, H hd)
    attn_update = attn.proj(out)  # (B, k, D)
    x_selected = gather_tokens(x, idx)
    delta = attn_update
    if config.route_part == "block":
        delta = attn_update + block.mlp(block.mlp_norm(x_selected + attn_update))
    weight = block.router.weight(router_logits.gather(1, idx)).unsqueeze(-1)  # (B, k, 1)
    x = x.clone()
    x.scatter_(1, idx[:, :, None].expand_as(x_selected), x_selected + weight * delta)
    if config.route_part == "attention":
        x = x + block.mlp(block.mlp_norm(x))
    return x


@torch.no_grad()
@pytest.mark.parametrize("part", ["block", "attention"])
def test_forward_equals_a_hand_written_reference(part):
    model = _model(route_part=part)
    tokens = torch.randint(0, 256, (2, 16))
    logits, aux = model(tokens, "topk", return_aux=True)
    records = {record.layer: record for record in aux.records}
    cos, sin = config_rope(model.config, torch.arange(16))
    x = model.embed(tokens)
    for layer, block in enumerate(model.blocks):
        if layer in records:
            x = _reference_block(block, x, records[layer].selection.selected_idx, records[layer].router_logits)
        else:
            x = block(x, cos, sin, "topk")[0]
    torch.testing.assert_close(model.head(model.norm(x)), logits, atol=ATOL, rtol=0)
    without = MoDDecoder(tiny_model_config(route_part=part, n_kv_heads=2)).eval()
    without.load_state_dict(model.state_dict())
    assert (without(tokens, "topk") - logits).abs().max() > 1e-3  # the option changes what the model computes


@torch.no_grad()
def test_capacity_one_without_gating_is_the_unrouted_block():
    model = _model(capacity=1.0, router_weight="none")
    dense = MoDDecoder(model.config.dense_twin()).eval()
    dense.load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens, "topk"), dense(tokens), atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("part", ["block", "attention"])
@pytest.mark.parametrize("mode", ["router", "predictor"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_cached_decoding_equals_the_causal_full_forward(part, mode, qk_norm):
    model = _model(route_part=part, qk_norm=qk_norm)  # qk_norm: the K/V-only and query-only projections norm too
    tokens = torch.randint(0, 256, (3, 14))
    full = model(tokens, mode)  # (B, T, V)
    cache = DecoderCache.allocate(model.config, 3, 14, CPU)
    steps = [model(tokens[:, :4], mode, cache=cache)]
    steps += [model.decode_step(tokens[:, t], cache, mode)[:, None] for t in range(4, 14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    for layer in range(model.config.n_layers):  # every layer stores every token, routed ones too
        assert cache.layers[layer].lengths.tolist() == [14, 14, 14]
        assert cache.layers[layer].slots == 14  # allocated like a dense layer


@torch.no_grad()
def test_padded_prefill_caches_every_real_token_and_decodes_like_the_unpadded_rows():
    model = _model()
    tokens = torch.randint(0, 256, (2, 10))
    lengths = torch.tensor([10, 6])
    cache = DecoderCache.allocate(model.config, 2, 14, CPU)
    logits = model(tokens, "router", cache=cache, lengths=lengths)
    for layer in model.config.routed_layers():
        assert cache.layers[layer].lengths.tolist() == [10, 6]
    following = torch.randint(0, 256, (2,))
    step = model.decode_step(following, cache, "router")
    alone = model(torch.cat([tokens[1, :6], following[1:]])[None], "router")  # (1, 7, V)
    torch.testing.assert_close(logits[1, 5], alone[0, 5], atol=ATOL, rtol=0)
    torch.testing.assert_close(step[1], alone[0, 6], atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize(("part", "options"), [("block", {}), ("attention", {}), ("block", {"branch_free": True}),
                                               ("block", {"row_cap": True}), ("block", {"qk_norm": True})])
def test_static_decode_step_equals_eager(part, options):
    model = _model(route_part=part, qk_norm=options.get("qk_norm", False))
    mode = model.causal_modes()[0]
    batch = 4
    tokens = torch.randint(0, 256, (batch, 10))
    static = StaticDecoder(model, batch, 20, mode, CPU, "float32", compile=False,
                           branch_free=options.get("branch_free", False))
    if options.get("row_cap"):
        static._step_module.graph.row_cap = 1
    graph = static._step_module.graph
    assert graph.processed_row_layers == () and set(graph.every_row_layers) == set(range(model.config.n_layers))
    cache = DecoderCache.allocate(model.config, batch, 20, CPU)
    static.prefill(tokens)
    model(tokens, mode, cache=cache)
    for token in torch.randint(0, 256, (6, batch)):
        torch.testing.assert_close(static.step(token), model.decode_step(token, cache, mode), atol=ATOL, rtol=0)
    for layer in model.config.routed_layers():
        assert static.cache.layers[layer].lengths.tolist() == [16] * batch


def test_flops_count_every_tokens_keys_and_values_and_the_selected_queries():
    config = tiny_model_config(keep_skipped_kv=True, n_kv_heads=2, route_layers=[1], route_every=0)
    base = tiny_model_config(n_kv_heads=2, route_layers=[1], route_every=0)
    seq_len, d = 32, config.d_model
    k = config.capacity_tokens(seq_len)
    q_width, kv_width = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    extra_proj = 2 * (seq_len - k) * d * 2 * kv_width  # skipped tokens' K/V projections
    extra_scores = 2 * 2 * k * (seq_len - k) * q_width  # the selected queries against every key: k x T
    with_kv, without = flops(config, seq_len), flops(base, seq_len)
    assert with_kv.attention_proj - without.attention_proj == extra_proj
    assert with_kv.attention_scores - without.attention_scores == extra_scores
    assert with_kv.mlp == without.mlp


def test_refused_with_route_part_mlp_and_by_other_families():
    with pytest.raises(UserError, match="--keep-skipped-kv"):
        tiny_model_config(keep_skipped_kv=True, route_part="mlp")
    with pytest.raises(UserError, match="--keep-skipped-kv is a Mixture-of-Depths option"):
        ModelConfig(n_layers=4, arch="early-exit", keep_skipped_kv=True)


@pytest.mark.parametrize(("flags", "says"), [
    (["--route-part", "mlp"], "--keep-skipped-kv"),
    (["--arch", "early-exit"], "--keep-skipped-kv is a Mixture-of-Depths option"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, flags, says):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--keep-skipped-kv", *flags, "--max-steps", "1", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert not out.exists()
