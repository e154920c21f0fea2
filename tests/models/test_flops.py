"""Analytic FLOPs against torch.utils.flop_counter on the parts both count (matmuls and attention)."""

from __future__ import annotations

import pytest
import torch

from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.models.flops import counted_flops, decode_step_flops, flops, training_flops
from modcli.training.objective import lm_loss, routing_losses
from tests.conftest import tiny_model_config

SHAPES = [dict(route_every=0), dict(capacity=0.125, seq_len=64), dict(capacity=0.5),
          dict(route_every=1, route_offset=0, tie_embeddings=False), dict(predictor_hidden=0),
          dict(router="attention"), dict(router="random"), dict(router_hidden=8),
          dict(n_kv_heads=2, head_size=16, qkv_bias=True), dict(n_kv_heads=2, head_size=12, qk_norm=True)]


@pytest.mark.parametrize("overrides", SHAPES)
def test_analytic_forward_flops_equal_the_flop_counter(overrides):
    config = tiny_model_config(**overrides)
    model = MoDDecoder(config).eval()
    tokens = torch.randint(0, 256, (2, config.seq_len))
    with torch.no_grad():
        counted = counted_flops(lambda: model(tokens, "topk"))
    assert "_scaled_dot_product_flash_attention_for_cpu" in counted  # attention is counted, not left out
    assert sum(counted.values()) == 2 * flops(config, config.seq_len).total


@pytest.mark.parametrize("overrides", SHAPES)
def test_analytic_training_flops_equal_the_flop_counter_over_forward_and_backward(overrides):
    config = tiny_model_config(**overrides)
    model = MoDDecoder(config).train()
    tokens = torch.randint(0, 256, (2, config.seq_len))

    def forward_backward() -> None:
        logits, aux = model(tokens, "topk", return_aux=True)
        records = aux.records
        router_bce, predictor_bce = routing_losses(records)
        (lm_loss(logits, tokens) + 0.1 * router_bce + predictor_bce).backward()

    counted = counted_flops(forward_backward)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in counted  # attention's backward too
    assert sum(counted.values()) == 2 * training_flops(config, config.seq_len)


@pytest.mark.parametrize("routing", ["router", "predictor"])
@pytest.mark.parametrize("overrides", [dict(route_every=0), dict(capacity=0.5), dict(route_every=1, route_offset=0)])
@torch.no_grad()
def test_analytic_decode_step_flops_equal_the_flop_counter(overrides, routing):
    torch.manual_seed(0)
    config = tiny_model_config(**overrides)
    model = MoDDecoder(config).eval()
    for block in model.blocks:
        if block.routed:  # about half the rows process each token: both kinds of row are counted
            block.router.score.bias.zero_()
            block.router.predictor.net[-1].bias.zero_()
    batch, prompt = 3, 9
    cache = DecoderCache.allocate(config, batch, prompt + 6, torch.device("cpu"))
    model(torch.randint(0, 256, (batch, prompt)), routing, cache=cache)
    seen = 0
    for _ in range(6):
        before = [layer.lengths.clone() for layer in cache.layers]
        counted = counted_flops(lambda: model.decode_step(torch.randint(0, 256, (batch,)), cache, routing))
        work = {i: (int((layer.lengths - before[i]).sum()), layer.max_length) for i, layer in enumerate(cache.layers)}
        seen += sum(rows for rows, _ in work.values())
        assert sum(counted.values()) == decode_step_flops(config, batch, work, routing).total
    assert seen > 0


def test_routed_blocks_count_only_their_k_tokens():
    dense = tiny_model_config(route_every=0, seq_len=256)
    mod = tiny_model_config(route_every=2, capacity=0.125, seq_len=256)
    ratio = flops(mod, 256).total / flops(dense, 256).total
    assert ratio < 0.7  # half the blocks at 1/8 of the tokens, plus the head
