"""--keep-first N: routed blocks always process positions 0..N-1 (the attention sink of a pretrained model), in
the full-sequence mode, the causal modes, cached decoding and the static decode step."""

from __future__ import annotations

import pytest
import torch

from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from tests.conftest import tiny_model_config

ATOL = 1e-4


def _model(**overrides) -> MoDDecoder:
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(keep_first=3, capacity=0.125, **overrides)).eval()
    with torch.no_grad():  # the causal rules would skip every token: only --keep-first makes them process any
        for block in model.blocks:
            if block.router is not None:
                block.router.score.bias.fill_(-50.0)
                block.router.predictor.net[-1].bias.fill_(-50.0)
    return model


@torch.no_grad()
@pytest.mark.parametrize("mode", ["topk", "router", "predictor"])
def test_the_first_positions_are_processed_in_every_mode(mode):
    model = _model()
    _, aux = model(torch.randint(0, 256, (2, 32)), mode, return_aux=True)
    assert aux.records
    for record in aux.records:
        selection = record.selection
        valid = torch.ones_like(selection.selected_idx, dtype=torch.bool) if selection.valid is None else selection.valid
        for row in range(2):
            chosen = set(selection.selected_idx[row][valid[row]].tolist())
            assert {0, 1, 2} <= chosen, (mode, record.layer, chosen)
            if mode != "topk":  # the causal rules skip everything else here
                assert chosen == {0, 1, 2}


@torch.no_grad()
def test_cached_decoding_equals_the_causal_full_forward():
    model = _model()
    tokens = torch.randint(0, 256, (2, 12))
    full = model(tokens, "router")  # (B, T, V)
    cache = DecoderCache.allocate(model.config, 2, 12, torch.device("cpu"))
    steps = [model(tokens[:, :1], "router", cache=cache)[:, -1]]
    steps += [model.decode_step(tokens[:, t], cache, "router") for t in range(1, 12)]
    torch.testing.assert_close(torch.stack(steps, dim=1), full, atol=ATOL, rtol=0)
    for layer in model.config.routed_layers():  # decoding processed positions 1 and 2 as the full pass did
        assert cache.layers[layer].lengths.tolist() == [3, 3]


def test_keep_first_is_refused_when_negative_and_by_families_without_mod_routing():
    from modcli.config import ModelConfig
    from modcli.errors import UserError

    with pytest.raises(UserError, match="--keep-first must be >= 0"):
        ModelConfig(keep_first=-1)
    with pytest.raises(UserError, match="--keep-first is a Mixture-of-Depths option"):
        ModelConfig(arch="early-exit", keep_first=1)


@pytest.mark.slow
def test_the_exported_graphs_keep_the_first_positions_and_validate(tmp_path):
    """The forward and decode graphs carry --keep-first: `modcli export`'s own validation (onnxruntime against
    eager PyTorch, forward and greedy decoding) passes."""
    from modcli.bundle.writer import ExportConfig, export
    from tests.bundle.test_export import random_checkpoint

    checkpoint = random_checkpoint(tmp_path / "run", keep_first=2)
    result = export(ExportConfig(checkpoint=str(checkpoint), out=str(tmp_path / "bundle"), provider="cpu"))
    assert result.valid, result.failures
