"""The extension points for model families and router kinds: a toy family registered in this test alone (its spec,
its decoder, an option of its own, its own auxiliary loss, a decoding option and hook of its own, an evaluation loss
of its own) trains, evaluates, profiles and decodes through the commands, and export refuses it with its own reason;
a toy router with an option of its own trains. Each option is a flag of `modcli train` (a decoding option of
`modcli generate`), reaches the model and is saved in config.json. Nothing in modcli names either."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import ModelConfig, TrainConfig
from modcli.decode.generation import GenerateConfig, generate
from modcli.errors import UserError
from modcli.models.decoder import MoDDecoder
from modcli.models.families import FAMILIES, Family
from modcli.models.routing import registry
from modcli.models.routing.registry import RouterSpec
from modcli.models.routing.topk import TopKRouter
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
class ToyOptions:
    """The toy family's own options."""

    logit_penalty: float = 1e-3
    """--arch toy: weight of the toy's penalty on the mean squared logit."""

    def __post_init__(self) -> None:
        if self.logit_penalty < 0:
            raise UserError(f"--logit-penalty must be >= 0, got {self.logit_penalty}")


@dataclass(frozen=True)
class ToyDecodingOptions:
    """The toy family's own option of `modcli generate`."""

    logit_scale: float | None = None
    """--arch toy: decode with every step's logits multiplied by this (greedy text unchanged); None = off."""

    def __post_init__(self) -> None:
        if self.logit_scale is not None and not self.logit_scale > 0:
            raise UserError(f"--logit-scale must be > 0, got {self.logit_scale}")


class ScaledLogits:
    """The toy's decoding (modcli.decode.generation.FamilyDecoding): generate's loop with a step of its own."""

    spare_tokens = 0

    def __init__(self, model, scale: float) -> None:
        self.model, self.scale, self.steps = model, scale, 0

    def step_rows(self, batch: int) -> int:
        return batch

    def decode(self, run) -> list[list[int]]:
        def step(tokens):
            self.steps += 1
            with run.autocast():
                return self.model.decode_step(tokens, run.cache, "dense").float() * self.scale

        return run.steps(step)

    def result_fields(self, batch: int) -> dict:
        return {"decoding": f"toy (logits x {self.scale:g}, {self.steps} steps)"}


def toy_decoding(model, options: ToyDecodingOptions):
    return ScaledLogits(model, options.logit_scale) if options.logit_scale is not None else None


@dataclass(frozen=True)
class Toy(Family):
    def describe(self, config) -> str:
        return f"toy ({config.n_layers} dense blocks)"

    def evaluation_losses(self, model, inputs, targets) -> dict:
        return {"logit_square": model(inputs).float().pow(2).mean()}


def toy_loss(aux, targets, config, train):
    return [LossTerm("toy_loss", aux.extras["logit_square"], config.family_options.logit_penalty)], {}


@pytest.fixture
def toy_family(monkeypatch):
    spec = Toy("toy", f"{__name__}:ToyDecoder", "a dense decoder with a logit penalty", options=ToyOptions,
               aux_losses=("toy",), mod_routing=False, experts=False, exportable=False, export_note=REASON,
               decoding_options=ToyDecodingOptions, decoding=f"{__name__}:toy_decoding")
    monkeypatch.setitem(FAMILIES, "toy", spec)
    monkeypatch.setitem(objective.AUX_LOSSES, "toy", toy_loss)
    return spec


@dataclass(frozen=True)
class ShiftOptions:
    """The toy router's own options."""

    logit_shift: float = 0.0
    """--router shifted: a constant added to every router logit."""


class ShiftedRouter(TopKRouter):
    """The top-k router with its logits shifted by --logit-shift."""

    kind = "shifted"

    def __init__(self, config, layer: int) -> None:
        super().__init__(config, layer)
        self.shift = config.router_options.logit_shift

    def logits(self, x, positions, previous_attention=None):
        return super().logits(x, positions, previous_attention) + self.shift


@pytest.fixture
def toy_router(monkeypatch):
    spec = RouterSpec("shifted", f"{__name__}:ShiftedRouter", "top-k of shifted logits", options=ShiftOptions)
    monkeypatch.setitem(registry.ROUTERS, "shifted", spec)
    monkeypatch.setitem(registry.ROUTER_KINDS, "shifted", spec)
    return spec


def test_a_toy_family_registered_here_trains_evaluates_profiles_and_export_refuses_it(toy_family, tmp_path,
                                                                                        corpus_file):
    config = ModelConfig(arch="toy", d_model=32, n_layers=2, n_heads=4, seq_len=32)
    assert config.kind == "toy (2 dense blocks)" and config.dense and config.route_every == 0
    assert config.family_options == ToyOptions()
    assert isinstance(toy_family.model_class()(config), ToyDecoder)

    runner, run = CliRunner(), tmp_path / "run"
    shown = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400"}).output
    assert "--logit-penalty" in shown and "weight of the toy's penalty on the mean squared logit" in shown
    result = runner.invoke(app, ["train", "--logit-penalty", "0.5", "--out", str(tmp_path / "refused")])
    assert result.exit_code == 2 and "--logit-penalty is an option of --arch toy, not of --arch mod" in result.stderr
    result = runner.invoke(app, ["train", "--arch", "toy", "--logit-penalty", "-1", "--out", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "--logit-penalty must be >= 0" in result.stderr
    result = runner.invoke(app, ["train", "--arch", "toy", "--logit-penalty", "0.002", "--data", str(corpus_file),
                                 "--out", str(run),
                                 "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32",
                                 "--batch-size", "2", "--max-steps", "3", "--eval-every", "3", "--eval-batches", "1",
                                 "--log-every", "1", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2, 3]
    assert all(step["toy_loss"] > 0 for step in steps)  # the family's own loss, summed by the objective
    saved = json.loads(next(run.glob("step-*/config.json")).read_text())["model"]
    assert saved["arch"] == "toy" and saved["logit_penalty"] == 0.002  # flat beside the model's own fields

    result = runner.invoke(app, ["eval", str(run), "--batches", "1", "--batch-size", "2", "--device", "cpu",
                                 "--json"])
    assert result.exit_code == 0, result.output
    evaluated = json.loads(result.stdout)
    assert evaluated["kind"] == "toy (2 dense blocks)" and [r["routing"] for r in evaluated["results"]] == ["dense"]
    assert list(evaluated["exit_losses"]) == ["logit_square"] and evaluated["exit_losses"]["logit_square"] > 0

    result = runner.invoke(app, ["profile", str(run), "--seq-len", "16", "--batch-size", "2", "--repeats", "1",
                                 "--warmup", "0", "--decode-tokens", "2", "--no-memory", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"]["label"] == "toy (2 dense blocks)"

    result = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "bundle")])
    assert result.exit_code == 2 and REASON in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("penalty", [1e-3, 0.25])
def test_the_toy_loss_is_in_the_total_at_its_weight(toy_family, penalty):
    config = ModelConfig.of(arch="toy", d_model=32, n_layers=2, n_heads=4, seq_len=16, logit_penalty=penalty)
    model = ToyDecoder(config).train()
    tokens = torch.randint(0, 256, (2, 16))
    result = objective.training_loss(model, tokens, tokens.roll(-1, 1), TrainConfig())
    [term] = result.terms
    torch.testing.assert_close(result.total, result.lm + penalty * term.value)


def test_a_toy_router_registered_here_owns_its_option(toy_router, tmp_path, corpus_file):
    runner, run = CliRunner(), tmp_path / "run"
    shown = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400"}).output
    assert "--logit-shift" in shown and "a constant added to every router logit" in shown
    result = runner.invoke(app, ["train", "--logit-shift", "1", "--out", str(tmp_path / "refused")])
    assert result.exit_code == 2 and "--logit-shift is an option of --router shifted, not of --router topk" in \
        result.stderr
    result = runner.invoke(app, ["train", "--router", "shifted", "--logit-shift", "2.5", "--data", str(corpus_file),
                                 "--out", str(run), "--d-model", "32", "--n-layers", "2", "--n-heads", "4",
                                 "--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--eval-every", "2",
                                 "--eval-batches", "1", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    saved = json.loads(next(run.glob("step-*/config.json")).read_text())["model"]
    assert saved["router"] == "shifted" and saved["logit_shift"] == 2.5
    config = ModelConfig.of(**saved)
    model = config.family.model_class()(config)
    [router] = [block.router for block in model.blocks if block.router is not None]
    assert isinstance(router, ShiftedRouter) and router.shift == 2.5  # the option reached the model


def test_a_toy_familys_decoding_option_is_a_generate_flag_and_its_hook_decodes(toy_family, trained_run):
    runner = CliRunner()
    shown = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "400"}).output
    assert "--logit-scale" in shown and "decode with every step's logits multiplied by this" in shown
    assert "--exit-threshold" in shown  # every registered family's decoding options are flags
    cases = [
        (["--logit-scale", "2"], "--logit-scale needs a toy model (modcli train --arch toy); this one is MoD"),
        (["--logit-scale", "0"], "--logit-scale must be > 0, got 0.0"),
        (["--logit-scale", "2", "--exit-threshold", "0.5"], "are decoding options of different families"),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["generate", str(trained_run), "--device", "cpu", *args])
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    torch.manual_seed(0)
    model = ToyDecoder(ModelConfig(arch="toy", d_model=32, n_layers=2, n_heads=4, seq_len=32)).eval()
    settings = dict(prompts=["def ", "a"], max_new_tokens=6, temperature=0, device="cpu")
    full = generate(GenerateConfig.of("-", **settings), model=model)
    scaled = generate(GenerateConfig.of("-", logit_scale=2.0, **settings), model=model)
    assert full.decoding == "full" and scaled.decoding == "toy (logits x 2, 5 steps)"  # the hook ran the loop
    assert scaled.tokens == full.tokens  # a positive scale keeps the argmax
    with pytest.raises(UserError, match=r"--exit-threshold needs an early-exit model .*; this one is toy"):
        generate(GenerateConfig.of("-", exit_threshold=0.5, **settings), model=model)


@pytest.mark.parametrize("args, flag", [
    (["--exit-threshold", "0.5"], "--exit-threshold"),
    (["--speculative", "1", "--temperature", "0"], "--speculative"),
    (["--draft-tokens", "8"], "--draft-tokens"),
])
def test_a_decoding_option_of_another_family_is_one_line_and_exit_2(trained_run, args, flag):
    """Early exit's decoding options given for the MoD run: refused once the model is loaded, naming the flag."""
    result = CliRunner().invoke(app, ["generate", str(trained_run), "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert f"{flag} needs an early-exit model (modcli train --arch early-exit); this one is MoD" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
