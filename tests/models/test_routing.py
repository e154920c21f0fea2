"""The routed block: exactly k tokens change, the rest are bit-for-bit unchanged, causal order, gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.models.decoder import Block, MoDDecoder, rope_tables
from modcli.models.routing import select_causal, select_topk, topk_labels
from modcli.models.routing.selection import select_topk_sorted, select_topk_traced
from tests.conftest import tiny_model_config


def _routed_block(**overrides) -> Block:
    torch.manual_seed(0)
    config = tiny_model_config(**overrides)
    return Block(config, layer=config.routed_layers()[0]).eval()


def _rope(config: ModelConfig, seq_len: int):
    return rope_tables(torch.arange(seq_len), config.head_dim, config.rope_base)


def test_exactly_k_tokens_change_and_the_rest_are_bit_for_bit_unchanged():
    block = _routed_block(capacity=0.25)
    x = torch.randn(3, 32, 32)
    out, record = block(x, *_rope(block.config, 32), "topk")
    changed = (out != x).any(dim=-1)  # (B, T)
    assert changed.sum(dim=1).tolist() == [8, 8, 8]
    labels = topk_labels(record.selection.selected_idx, 32).bool()
    assert torch.equal(changed, labels)
    assert torch.equal(out[~labels], x[~labels])


def _brute_force_topk(scores: list[float], k: int) -> list[int]:
    """The rule in plain Python: highest score first, equal scores by position (lower first), then ascending."""
    ranked = sorted(range(len(scores)), key=lambda t: (-scores[t], t))
    return sorted(ranked[:k])


@pytest.mark.parametrize("select", [select_topk, select_topk_sorted, select_topk_traced],
                         ids=["dispatch", "eager-sort", "traced-rule"])
@settings(max_examples=200, deadline=None)
@given(data=st.data(), seq_len=st.integers(min_value=1, max_value=40), batch=st.integers(min_value=1, max_value=3))
def test_topk_selection_equals_brute_force_sorting_with_ties_to_the_lower_position(select, data, seq_len, batch):
    # Scores from a handful of values, so most draws hold exact ties at the k-th boundary.
    values = st.sampled_from([-1.5, 0.0, 0.25, 0.2500001, 2.0])
    rows = [data.draw(st.lists(values, min_size=seq_len, max_size=seq_len)) for _ in range(batch)]
    k = data.draw(st.integers(min_value=1, max_value=seq_len))
    scores = torch.tensor(rows)  # float32: the brute force sees the same (rounded) values
    selection = select(scores, k)
    assert selection.selected_idx.tolist() == [_brute_force_topk(row, k) for row in scores.tolist()]
    assert selection.counts.tolist() == [k] * batch and selection.valid is None


@pytest.mark.parametrize("select", [select_topk_sorted, select_topk_traced], ids=["eager-sort", "traced-rule"])
def test_ties_at_the_boundary_go_to_the_lower_position(select):
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0], [1.0] * 8, [0.0, -0.0, 0.0, -0.0] * 2])
    assert select(scores, 2).selected_idx.tolist() == [[0, 5], [0, 1], [0, 1]]
    assert select(scores, 4).selected_idx.tolist() == [[0, 1, 2, 5], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_eager_and_traced_top_k_agree_on_long_rows_with_runs_of_equal_scores():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (4, 2048), generator=generator).float() / 4  # long runs of ties at every k
    for k in (1, 7, 256, 1024, 2048):
        assert torch.equal(select_topk_sorted(scores, k).selected_idx, select_topk_traced(scores, k).selected_idx)


def test_a_compiled_top_k_takes_the_traced_rule(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    used = []
    monkeypatch.setattr("modcli.models.routing.selection.select_topk_traced",
                        lambda logits, k: used.append(k) or select_topk_sorted(logits, k))
    select_topk(torch.zeros(1, 8), 2)
    assert used == [2]


@pytest.mark.parametrize("seq_len, capacity, k", [
    (1024, 0.125, 128), (2048, 0.125, 256), (2049, 0.125, 256), (7, 0.125, 1), (8, 0.125, 1), (15, 0.125, 1),
    (16, 0.125, 2), (1, 0.125, 1), (1, 1.0, 1), (5, 1.0, 5), (3, 0.5, 1), (10, 0.3, 3), (256, 0.5, 128),
    (100, 0.29, 29),  # 0.29 * 100 = 28.999... in floats
    (100, 0.57, 57),  # 0.57 * 100 = 56.999... in floats
    (999, 0.3333333333, 333),  # read as 1/3; 999 * 0.3333333333 = 332.99999997
    (5000, 0.001, 5), (999, 0.001, 1),
])
def test_capacity_rounding_rule_against_hand_computed_k(seq_len, capacity, k):
    assert tiny_model_config(capacity=capacity).capacity_tokens(seq_len) == k


def test_causal_selection_pads_to_the_largest_count_and_keeps_order():
    decisions = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    selection = select_causal(decisions)
    assert selection.counts.tolist() == [3, 1, 0]
    assert selection.selected_idx.shape == (3, 3)
    assert selection.selected_idx[0].tolist() == [0, 2, 3]
    assert selection.selected_idx[1, 0].item() == 3
    assert selection.valid.tolist() == [[True, True, True], [True, False, False], [False, False, False]]


def test_router_receives_gradient_from_the_language_model_loss():
    block = _routed_block().train()
    x = torch.randn(2, 32, 32)
    out, _ = block(x, *_rope(block.config, 32), "topk")
    out.square().mean().backward()
    assert block.router.score.weight.grad is not None and block.router.score.weight.grad.abs().sum() > 0


def test_predictor_never_sends_gradient_into_the_main_model():
    block = _routed_block().train()
    x = torch.randn(2, 32, 32, requires_grad=True)
    _, record = block(x, *_rope(block.config, 32), "topk", want_predictor=True)
    record.predictor_logits.sum().backward()
    assert x.grad is None
    assert block.router.score.weight.grad is None
    assert block.router.predictor.net[0].weight.grad.abs().sum() > 0


def test_capacity_one_without_gating_equals_the_dense_block():
    routed = _routed_block(capacity=1.0, router_weight="none")
    dense = Block(tiny_model_config(route_every=0), layer=routed.layer).eval()
    dense.load_state_dict(routed.state_dict(), strict=False)
    x = torch.randn(2, 32, 32)
    rope = _rope(routed.config, 32)
    routed_out, _ = routed(x, *rope, "topk")
    dense_out, _ = dense(x, *rope, "topk")
    torch.testing.assert_close(routed_out, dense_out, atol=1e-6, rtol=0)


def test_routed_block_equals_dense_block_on_the_gathered_subsequence_at_original_positions():
    block = _routed_block(capacity=0.25, router_weight="none")
    x = torch.randn(2, 32, 32)
    out, record = block(x, *_rope(block.config, 32), "topk")
    idx = record.selection.selected_idx  # (B, k)
    for b in range(2):
        sub = x[b, idx[b]][None]  # (1, k, D)
        cos, sin = rope_tables(idx[b], block.config.head_dim, block.config.rope_base)
        expected = sub + block.delta(sub, cos[None], sin[None])
        torch.testing.assert_close(out[b, idx[b]], expected[0], atol=1e-5, rtol=0)


def test_positions_are_not_renumbered():
    """Renumbering the selected tokens 0..k-1 would give a different result: the test can fail."""
    block = _routed_block(capacity=0.25, router_weight="none")
    x = torch.randn(1, 32, 32)
    out, record = block(x, *_rope(block.config, 32), "topk")
    idx = record.selection.selected_idx[0]
    sub = x[0, idx][None]
    cos, sin = rope_tables(torch.arange(len(idx)), block.config.head_dim, block.config.rope_base)
    renumbered = sub + block.delta(sub, cos[None], sin[None])
    assert not torch.allclose(out[0, idx], renumbered[0], atol=1e-5)


def test_dense_model_is_the_same_code_with_routing_off():
    config = tiny_model_config(route_every=0)
    model = MoDDecoder(config)
    assert config.dense and not any(block.routed for block in model.blocks)
    assert all(block.router is None for block in model.blocks)


def test_unknown_routing_mode_is_a_user_error():
    model = MoDDecoder(tiny_model_config())
    with pytest.raises(UserError, match="--routing"):
        model(torch.zeros(1, 4, dtype=torch.long), "sideways")


@pytest.mark.parametrize("kwargs, flag", [
    (dict(capacity=1.5), "--capacity"), (dict(capacity=0.0), "--capacity"), (dict(d_model=30), "--d-model"),
    (dict(route_every=-1), "--route-every"), (dict(router_weight="tanh"), "--router-weight"),
    (dict(seq_len=1), "--seq-len"),
])
def test_config_validation_names_the_flag(kwargs, flag):
    with pytest.raises(UserError, match=flag):
        tiny_model_config(**kwargs)


def test_auxiliary_labels_refuse_the_records_of_a_causal_forward():
    from modcli.training.objective import routing_agreement, routing_losses

    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config()).eval()
    tokens = torch.randint(0, 256, (2, 32))
    _, aux = model(tokens, "topk", return_aux=True)
    records = aux.records
    router_bce, _ = routing_losses(records)  # top-k records: fine
    assert router_bce > 0
    _, causal_aux = model(tokens, "router", return_aux=True)
    causal = causal_aux.records
    assert any(record.selection.valid is not None for record in causal)
    with pytest.raises(ValueError, match="top-k forward"):
        routing_losses(causal)
    with pytest.raises(ValueError, match="top-k forward"):
        routing_agreement(causal)
