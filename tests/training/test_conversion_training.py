"""Converting a dense model: causal rules calibrated to the capacity (--calibrate) and the block-match objective."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import TrainConfig
from modcli.models.build import build_model
from modcli.models.routing.calibration import calibrate_causal_rules, processed_shares
from modcli.training.objective import block_match, training_loss
from tests.conftest import tiny_model_config

TOLERANCE = 0.02
"""How far from the capacity a calibrated share may be: a few tokens of the 4 x 64 (ties at the quantile)."""


def _tokens(seed: int = 0, batch: int = 4, seq_len: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("router,extra", [("topk", {}), ("threshold", {}), ("topk", {"keep_first": 1}),
                                          ("topk", {"route_part": "attention", "route_every": 1, "route_offset": 0})])
@pytest.mark.parametrize("capacity", [0.25, 0.75])
def test_calibration_makes_every_causal_rule_keep_the_capacity(router, extra, capacity):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(router=router, capacity=capacity, seq_len=64, router_weight="unit",
                                          **extra)).eval()
    tokens = _tokens()
    before = processed_shares(model, tokens)
    shares = calibrate_causal_rules(model, tokens)
    assert shares == processed_shares(model, tokens)
    assert set(shares) == set(model.causal_modes())
    for mode, blocks in shares.items():
        assert set(blocks) == {f"block{layer}" for layer in model.config.routed_layers()}
        for block, share in blocks.items():
            assert abs(share - capacity) <= TOLERANCE + 1 / 64 * extra.get("keep_first", 0), (mode, block, share)
    # fresh routers did not keep the capacity before (the reason for calibrating)
    assert any(abs(share - capacity) > 0.1 for blocks in before.values() for share in blocks.values())
    # on other tokens of the same kind the shares stay near the capacity (a boundary, not a memorised batch)
    for blocks in processed_shares(model, _tokens(seed=1)).values():
        assert all(abs(share - capacity) < 0.15 for share in blocks.values())


def test_calibration_has_nothing_to_do_for_random_routing_or_a_dense_model():
    assert calibrate_causal_rules(build_model(tiny_model_config(router="random")), _tokens()) is None
    assert calibrate_causal_rules(build_model(tiny_model_config().dense_twin()), _tokens()) is None


def test_block_match_is_zero_with_every_token_processed_at_unit_weight():
    torch.manual_seed(0)
    model = build_model(tiny_model_config(router="topk", capacity=1.0, router_weight="unit", seq_len=64))
    loss, aux, per_block = block_match(model, _tokens())
    assert per_block.shape == (len(model.config.routed_layers()),)
    assert loss.item() == pytest.approx(0.0, abs=1e-10)
    assert [record.layer for record in aux.records] == model.config.routed_layers()


def test_block_match_of_a_constant_sigmoid_weight_is_its_shortfall_squared():
    """Every token processed with weight s = sigmoid(b): y - d = (s - 1) f(x), so each block's relative error is
    (1 - s)^2 exactly."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(router="topk", capacity=1.0, router_weight="sigmoid", seq_len=64))
    for block in model.blocks:
        if block.router is not None:
            torch.nn.init.zeros_(block.router.score.weight)
            torch.nn.init.constant_(block.router.score.bias, 0.3)
    _, _, per_block = block_match(model, _tokens())
    want = (1 - torch.sigmoid(torch.tensor(0.3))) ** 2
    torch.testing.assert_close(per_block, want.repeat(per_block.shape[0]), rtol=1e-4, atol=0)


@pytest.mark.parametrize("route_part", ["block", "attention", "mlp"])
def test_block_match_trains_the_routers_only_through_the_routed_blocks(route_part):
    """Below capacity 1 the loss is positive and its gradient reaches the routers; the backward never crosses a
    block: the embedding and the unrouted blocks get no gradient, though they could train."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(router="topk", capacity=0.5, router_weight="unit", seq_len=64,
                                          route_part=route_part))
    tokens = _tokens()
    objective = training_loss(model, tokens, tokens, TrainConfig(objective="block-match"))
    assert objective.lm.item() > 0 and [term.name for term in objective.terms] == ["router_aux_loss",
                                                                                     "predictor_loss"]
    objective.total.backward()
    routed = set(model.config.routed_layers())
    for name, param in model.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
        if ".router." in name and ".predictor." not in name and name.endswith("weight"):
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        if layer is None or layer not in routed:
            assert param.grad is None, name
    assert set(objective.readers["block_match"]()) == {f"block{layer}" for layer in routed}


def test_train_init_from_calibrates_by_default_and_records_it(trained_dense_run, corpus_file, tmp_path):
    runner = CliRunner()
    common = ["train", "--init-from", str(trained_dense_run), "--data", str(corpus_file), "--router", "topk",
              "--capacity", "0.25", "--predictor-hidden", "16", "--batch-size", "4", "--max-steps", "1",
              "--eval-every", "1", "--eval-batches", "1", "--trainable", "routers", "--device", "cpu", "--json"]
    result = runner.invoke(app, [*common, "--out", str(tmp_path / "calibrated")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert set(summary["calibration"]) == {"router", "predictor"}
    for blocks in summary["calibration"].values():
        assert all(abs(share - 0.25) <= TOLERANCE for share in blocks.values()), blocks
    saved = json.loads((tmp_path / "calibrated" / "step-00000001" / "config.json").read_text())
    assert saved["train"]["calibrate"] is True and saved["model"]["router_weight"] == "unit"

    result = runner.invoke(app, [*common, "--no-calibrate", "--out", str(tmp_path / "plain")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["calibration"] is None
    saved = json.loads((tmp_path / "plain" / "step-00000001" / "config.json").read_text())
    assert saved["train"]["calibrate"] is False


def test_train_with_the_block_match_objective(trained_dense_run, corpus_file, tmp_path):
    runner = CliRunner()
    common = ["train", "--init-from", str(trained_dense_run), "--data", str(corpus_file), "--capacity", "0.5",
              "--batch-size", "4", "--max-steps", "3", "--eval-every", "3", "--eval-batches", "1",
              "--log-every", "1", "--trainable", "routers", "--device", "cpu"]
    result = runner.invoke(app, [*common, "--objective", "block-match", "--out", str(tmp_path / "bm"), "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "bm" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < record["loss"] for record in records) and "val_loss_router" in records[-1]
    assert set(records[0]["block_match"]) == {"block1", "block3"}

    result = runner.invoke(app, [*common, "--objective", "distil", "--out", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "--objective must be one of lm, block-match, distill, got 'distil'" in result.stderr
    result = runner.invoke(app, [*common, "--router", "attention", "--objective", "block-match",
                                 "--out", str(tmp_path / "bad2")])
    assert result.exit_code == 2 and "reads the attention of the block before" in result.stderr
