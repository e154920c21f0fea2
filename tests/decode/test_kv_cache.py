"""LayerKVCache's append: the fast path when every row appends to equally long rows, against the general path."""

from __future__ import annotations

import pytest
import torch

from modcli.models.cache import DecoderCache, LayerKVCache
from tests.decode.test_decoding import _model


def _cache(batch: int = 3) -> LayerKVCache:
    return LayerKVCache(batch, 2, 4, 16, 16, torch.device("cpu"), torch.float32)


def _attend(cache: LayerKVCache, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """What a decode attention reads: its keys and values under the returned mask, masked slots zeroed."""
    keys, values, mask = cache.append(rows, new, -new)
    if mask is not None:
        keys = keys.masked_fill(~mask.transpose(-1, -2), 0.0)
        values = values.masked_fill(~mask.transpose(-1, -2), 0.0)
    return torch.cat([keys, values], dim=-1)


def test_every_row_appending_to_equal_rows_takes_the_fast_path_and_reads_what_the_general_path_reads():
    torch.manual_seed(0)
    fast, general = _cache(), _cache()
    prefix = torch.randn(3, 2, 5, 4)
    for cache in (fast, general):
        cache.write_prefix(torch.arange(3), prefix, -prefix, torch.full((3,), 5))
    rows = torch.arange(3)
    for _ in range(4):
        new = torch.randn(3, 2, 1, 4)
        general.full = False  # forced onto the indexed writes and the mask
        expected = _attend(general, rows, new)
        keys, values, mask = fast.append(rows, new, -new)
        assert mask is None and fast.full is True
        torch.testing.assert_close(torch.cat([keys, values], dim=-1), expected, atol=0, rtol=0)
    assert fast.lengths.tolist() == general.lengths.tolist() == [9, 9, 9]
    assert fast.max_length == general.max_length == 9


def test_rows_of_different_lengths_keep_the_mask():
    cache = _cache()
    prefix = torch.randn(3, 2, 5, 4)
    cache.write_prefix(torch.arange(3), prefix, -prefix, torch.tensor([5, 3, 4]))
    _, _, mask = cache.append(torch.arange(3), torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    assert cache.full is False and mask is not None
    assert mask[:, 0, 0].sum(dim=-1).tolist() == [6, 4, 5]  # each row's own slots, the new one included
    assert cache.lengths.tolist() == [6, 4, 5]


def test_a_routed_append_of_some_rows_leaves_the_fast_path_and_forgetting_rows_checks_again():
    cache = _cache()
    cache.append(torch.arange(3), torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    assert cache.full is True
    cache.append(torch.tensor([1]), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert cache.full is False and cache.lengths.tolist() == [1, 2, 1]
    _, _, mask = cache.append(torch.arange(3), torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    assert mask is not None and cache.lengths.tolist() == [2, 3, 2]
    cache.truncate(torch.tensor([2, 2, 2]))
    assert cache.full is None
    _, _, mask = cache.append(torch.arange(3), torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    assert mask is None and cache.lengths.tolist() == [3, 3, 3]
    cache.forget(torch.tensor([0]))
    assert cache.full is None and cache.lengths.tolist() == [0, 3, 3]


@pytest.mark.parametrize("dense", [True, False])
@torch.no_grad()
def test_decoding_logits_are_bit_for_bit_those_of_the_masked_path(dense):
    model = _model(route_every=0) if dense else _model()
    tokens = torch.randint(0, 256, (3, 24))

    def decode(force_general: bool) -> torch.Tensor:
        cache = DecoderCache.allocate(model.config, 3, 24, torch.device("cpu"))
        logits = [model(tokens[:, :8], "predictor", cache=cache)[:, -1]]
        for t in range(8, 24):
            if force_general:
                for layer in cache.layers:
                    layer.full = False
            logits.append(model.decode_step(tokens[:, t], cache, "predictor"))
        return torch.stack(logits, dim=1)

    torch.testing.assert_close(decode(False), decode(True), atol=0, rtol=0)
