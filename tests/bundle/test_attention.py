"""The exported graphs' causal attention (modcli.bundle.attention) equals PyTorch's, and onnxruntime's fusions keep
the graphs equal to eager PyTorch (modcli.bundle.fusion)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from modcli.bundle import attention
from modcli.bundle.attention import LONG_BLOCKS, MASK_MARGIN, translation_table
from modcli.bundle.fusion import fuse_graph
from modcli.bundle.lowering import forward_spec, onnx_summary
from modcli.models.decoder import MoDDecoder
from tests.conftest import tiny_model_config

ATOL = 1e-5


class Sdpa(nn.Module):
    def __init__(self, causal: bool = True, masked: bool = False) -> None:
        super().__init__()
        self.causal, self.masked = causal, masked

    def forward(self, q, k, v):
        if self.masked:  # an explicit boolean mask: the exporter's own translation
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def export_session(module: nn.Module, path: Path, sample: tuple[torch.Tensor, ...]):
    import onnxruntime as ort

    seq = Dim("seq", min=2)
    program = torch.export.export(module, sample, dynamic_shapes=tuple({2: seq} for _ in sample), strict=False)
    torch.onnx.export(program, sample, dynamo=True, opset_version=18, input_names=["q", "k", "v"],
                      custom_translation_table=translation_table()).save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def qkv(batch: int, heads: int, length: int, head_dim: int, seed: int, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, length, head_dim, generator=generator) * scale for _ in range(3))


def run(session, q, k, v) -> np.ndarray:
    return session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()})[0]


def test_causal_attention_equals_pytorch_at_every_length(tmp_path):
    session = export_session(Sdpa(), tmp_path / "sdpa.onnx", qkv(2, 3, 9, 8, 0))
    ops = onnx_summary(tmp_path / "sdpa.onnx")[0]
    # one If: the single block, or LONG_BLOCKS blocks of queries for sequences longer than LONG_BLOCK
    assert ops.get("If") == 1 and ops.get("Softmax") == ops.get("Trilu") == ops.get("ReduceMax") == 1 + LONG_BLOCKS
    for length in (2, 5, 17, 64, 256, 257, 600):
        q, k, v = qkv(2, 3, length, 8, length)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).numpy()
        np.testing.assert_allclose(run(session, q, k, v), expected, atol=ATOL, rtol=0)


def test_blocked_long_sequence_path_equals_pytorch_with_empty_and_remainder_blocks(tmp_path, monkeypatch):
    # Blocks of 4 rows, 3 blocks: length 5 leaves the first block empty, length 13 gives it 5 rows (the remainder).
    monkeypatch.setattr(attention, "LONG_BLOCK", 4)
    monkeypatch.setattr(attention, "LONG_BLOCKS", 3)
    session = export_session(Sdpa(), tmp_path / "sdpa.onnx", qkv(2, 3, 9, 8, 0))
    assert onnx_summary(tmp_path / "sdpa.onnx")[0].get("Softmax") == 1 + 3
    for length in (2, 4, 5, 8, 9, 12, 13, 31):
        q, k, v = qkv(2, 3, length, 8, 100 + length, scale=3.0)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).numpy()
        np.testing.assert_allclose(run(session, q, k, v), expected, atol=ATOL, rtol=0)


def test_without_the_exporters_tracer_the_graph_has_the_single_block(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "_exporter_tracer", lambda: None)
    session = export_session(Sdpa(), tmp_path / "sdpa.onnx", qkv(2, 3, 9, 8, 0))
    ops = onnx_summary(tmp_path / "sdpa.onnx")[0]
    assert "If" not in ops and ops.get("Softmax") == ops.get("Trilu") == 1
    q, k, v = qkv(2, 3, 300, 8, 7)
    np.testing.assert_allclose(run(session, q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True).numpy(),
                               atol=ATOL, rtol=0)


def test_a_future_key_far_above_the_visible_scores_gets_no_weight(tmp_path):
    """Future scores 500 above the past (and past scores spread far beyond MASK_MARGIN): still exactly causal."""
    session = export_session(Sdpa(), tmp_path / "sdpa.onnx", qkv(1, 2, 9, 4, 0))
    q, k, v = qkv(1, 2, 12, 4, 3)
    q = torch.ones_like(q)
    k = torch.zeros_like(k)
    k[..., 6:, :] = 250.0  # scaled score q . k / sqrt(4) = 500 for keys 6.. (the future of queries 0-5)
    k[..., 1, :] = -4 * MASK_MARGIN  # one visible key far below the row's maximum
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = run(session, q, k, v)
    np.testing.assert_allclose(got, expected.numpy(), atol=ATOL, rtol=0)
    # queries before position 6 see only keys <= themselves: their output mixes only those values
    np.testing.assert_allclose(got[..., 0, :], v[..., 0, :].numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("module", [Sdpa(causal=False), Sdpa(masked=True)], ids=["not-causal", "explicit-mask"])
def test_other_attention_calls_keep_the_exporters_translation(module, tmp_path):
    session = export_session(module, tmp_path / "sdpa.onnx", qkv(1, 2, 9, 4, 0))
    assert "Trilu" not in onnx_summary(tmp_path / "sdpa.onnx")[0] or module.masked
    q, k, v = qkv(1, 2, 13, 4, 7)
    np.testing.assert_allclose(run(session, q, k, v), module(q, k, v).numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("overrides, long_block", [({}, None), ({"n_kv_heads": 2}, None), ({}, 4)],
                         ids=["mha", "gqa", "mha-blocked"])
def test_fused_forward_graph_equals_eager_pytorch(overrides, long_block, tmp_path, monkeypatch):
    import onnxruntime as ort

    from modcli.bundle.lowering import export_onnx, export_program

    if long_block:  # the 23 tokens below take the blocked path of the dense blocks' attention (blocks of 4 rows)
        monkeypatch.setattr(attention, "LONG_BLOCK", long_block)
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(**overrides)).eval()
    spec = forward_spec(model)
    path = tmp_path / "forward.onnx"
    export_onnx(spec, export_program(spec), path, 18)
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fused = fuse_graph(path, model.config.n_heads, model.config.d_model)
    assert fused == {"SimplifiedLayerNormalization": 2 * model.config.n_layers + 1,
                     "RotaryEmbedding": model.config.n_layers}  # one RoPE per block, routed or not
    for operator, count in fused.items():
        assert onnx_summary(path)[0][operator] == count
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    tokens = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = spec.module(tokens)[0].numpy()
    for graph in (plain, session):
        np.testing.assert_allclose(graph.run(None, {"tokens": tokens.numpy()})[0], expected, atol=1e-4, rtol=0)


def test_decode_attention_ignores_unfilled_cache_slots_and_equals_attention_over_the_filled_ones():
    """attend_cache_and_self (the decode graph's attention): slots at or beyond lengths[b] get weight exactly 0,
    whatever finite values they hold, and the result equals softmax attention over the filled slots + self."""
    from modcli.decode.graphs import attend_cache_and_self

    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, slots, head_dim = 2, 4, 2, 40, 8
    q = torch.randn(batch, heads, 1, head_dim, generator=generator)
    keys, values = (torch.randn(batch, kv_heads, slots, head_dim, generator=generator) for _ in range(2))
    key_self, value_self = (torch.randn(batch, kv_heads, 1, head_dim, generator=generator) for _ in range(2))
    lengths = torch.tensor([3, 25])
    keys[0, :, 3:], values[0, :, 3:] = 1e30, 1e30  # stale rows far above any visible score and value
    keys[1, :, 25:], values[1, :, 25:] = -1e30, -1e30
    got = attend_cache_and_self(q, keys, values, lengths, key_self, value_self)
    for b, n in enumerate(lengths.tolist()):
        k = torch.cat([keys[b, :, :n], key_self[b]], dim=1).repeat_interleave(heads // kv_heads, dim=0)
        v = torch.cat([values[b, :, :n], value_self[b]], dim=1).repeat_interleave(heads // kv_heads, dim=0)
        expected = F.scaled_dot_product_attention(q[b], k, v)  # (H, 1, hd)
        torch.testing.assert_close(got[b], expected, atol=ATOL, rtol=0)


def test_fusing_a_graph_with_external_weights_keeps_them_external(tmp_path):
    """Graphs over protobuf's 2 GB are exported with their weights in a separate file; fusion writes them back so."""
    import onnx
    import onnxruntime as ort

    from modcli.bundle.lowering import export_onnx, export_program

    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config()).eval()
    spec = forward_spec(model)
    path = tmp_path / "forward.onnx"
    export_onnx(spec, export_program(spec), path, 18)
    onnx.save(onnx.load(str(path)), str(path), save_as_external_data=True, location="forward.onnx.data",
              size_threshold=0)
    assert fuse_graph(path, model.config.n_heads, model.config.d_model)
    graph = onnx.load(str(path), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.graph.initializer)
    tokens = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = spec.module(tokens)[0].numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"tokens": tokens.numpy()})[0], expected, atol=1e-4, rtol=0)
