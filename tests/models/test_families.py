"""The one extension point for model families: a toy family registered in this test alone (its spec, its decoder,
its own auxiliary loss) trains, evaluates and profiles through the commands, and export refuses it with its own
reason. Nothing in modcli names it."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import ModelConfig, TrainConfig
from modcli.models.decoder import MoDDecoder
from modcli.models.families import FAMILIES, Family
from modcli.training import objective
from modcli.training.objective import LossTerm

REASON = "toy models stay in PyTorch"


class ToyDecoder(MoDDecoder):
    """The dense decoder whose forward also returns the mean squared logit, for the toy family's own loss."""

    def forward(self, tokens, routing=None, *, return_aux=False, **kwargs):
        out = super().forward(tokens, routing, return_aux=return_aux, **kwargs)
        if not return_aux:
            return out
        logits, aux = out
        aux.extras["logit_square"] = logits.float().pow(2).mean()
        return logits, aux


@dataclass(frozen=True)
class Toy(Family):
    def describe(self, config) -> str:
        return f"toy ({config.n_layers} dense blocks)"


def toy_loss(aux, targets, config, train):
    return [LossTerm("toy_loss", aux.extras["logit_square"], 1e-3)], {}


@pytest.fixture
def toy_family(monkeypatch):
    spec = Toy("toy", f"{__name__}:ToyDecoder", "a dense decoder with a logit penalty", aux_losses=("toy",),
               mod_routing=False, experts=False, exportable=False, export_note=REASON)
    monkeypatch.setitem(FAMILIES, "toy", spec)
    monkeypatch.setitem(objective.AUX_LOSSES, "toy", toy_loss)
    return spec


def test_a_toy_family_registered_here_trains_evaluates_profiles_and_export_refuses_it(toy_family, tmp_path,
                                                                                        corpus_file):
    config = ModelConfig(arch="toy", d_model=32, n_layers=2, n_heads=4, seq_len=32)
    assert config.kind == "toy (2 dense blocks)" and config.dense and config.route_every == 0
    assert isinstance(toy_family.model_class()(config), ToyDecoder)

    runner, run = CliRunner(), tmp_path / "run"
    result = runner.invoke(app, ["train", "--arch", "toy", "--data", str(corpus_file), "--out", str(run),
                                 "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32",
                                 "--batch-size", "2", "--max-steps", "3", "--eval-every", "3", "--eval-batches", "1",
                                 "--log-every", "1", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2, 3]
    assert all(step["toy_loss"] > 0 for step in steps)  # the family's own loss, summed by the objective

    result = runner.invoke(app, ["eval", str(run), "--batches", "1", "--batch-size", "2", "--device", "cpu",
                                 "--json"])
    assert result.exit_code == 0, result.output
    evaluated = json.loads(result.stdout)
    assert evaluated["kind"] == "toy (2 dense blocks)" and [r["routing"] for r in evaluated["results"]] == ["dense"]

    result = runner.invoke(app, ["profile", str(run), "--seq-len", "16", "--batch-size", "2", "--repeats", "1",
                                 "--warmup", "0", "--decode-tokens", "2", "--no-memory", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"]["label"] == "toy (2 dense blocks)"

    result = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "bundle")])
    assert result.exit_code == 2 and REASON in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "bundle").exists()


def test_the_toy_loss_is_in_the_total_at_its_weight(toy_family):
    model = ToyDecoder(ModelConfig(arch="toy", d_model=32, n_layers=2, n_heads=4, seq_len=16)).train()
    tokens = torch.randint(0, 256, (2, 16))
    result = objective.training_loss(model, tokens, tokens.roll(-1, 1), TrainConfig())
    [term] = result.terms
    torch.testing.assert_close(result.total, result.lm + 1e-3 * term.value)
