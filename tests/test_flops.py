"""Analytic FLOPs against torch.utils.flop_counter on the parts both count (matmuls and attention)."""

from __future__ import annotations

import pytest
import torch

from modcli.flops import counted_flops, flops, training_flops
from modcli.model import MoDDecoder
from tests.conftest import tiny_model_config


@pytest.mark.parametrize("overrides", [dict(route_every=0), dict(capacity=0.125, seq_len=64), dict(capacity=0.5),
                                       dict(route_every=1, route_offset=0, tie_embeddings=False)])
def test_analytic_flops_match_the_flop_counter(overrides):
    config = tiny_model_config(**overrides)
    model = MoDDecoder(config).eval()
    tokens = torch.randint(0, 256, (2, config.seq_len))
    with torch.no_grad():
        counted = counted_flops(lambda: model(tokens, "topk"))
    analytic = flops(config, config.seq_len)
    assert "_scaled_dot_product_flash_attention_for_cpu" in counted  # attention is counted, not left out
    assert sum(counted.values()) / 2 == pytest.approx(analytic.total, rel=0.05)


def test_routed_blocks_count_only_their_k_tokens():
    dense = tiny_model_config(route_every=0, seq_len=256)
    mod = tiny_model_config(route_every=2, capacity=0.125, seq_len=256)
    ratio = flops(mod, 256).total / flops(dense, 256).total
    assert ratio < 0.7  # half the blocks at 1/8 of the tokens, plus the head
    assert training_flops(mod, 256) == 3 * flops(mod, 256, include_predictor=True).total
