"""Files written by modcli 0.1.0 (tests/fixtures/legacy_v0_1_0, made by main before the package layout) still
load, evaluate and decode with the current code, to the same numbers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import modcli
from modcli.cli import app

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_v0_1_0"
PROMPT = "def f_3(x):"  # the prompt and length the fixture's gen.json and rungen.json were made with
MAX_NEW_TOKENS = "16"


def expected(name: str) -> dict:
    return json.loads((FIXTURE / name).read_text())


@pytest.fixture
def legacy(tmp_path, monkeypatch) -> Path:
    """A copy of the fixture to work in (nothing writes into the fixture), as the current folder: the fixture's
    outputs were made with the relative paths `run`, `bundle` and `corpus.txt`."""
    copy = tmp_path / "legacy"
    shutil.copytree(FIXTURE, copy)
    monkeypatch.chdir(copy)
    return copy


def run_modcli(*args: str) -> dict:
    result = CliRunner().invoke(app, [*args, "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_eval_gives_the_same_losses_and_processed_fractions_per_routing_mode(legacy):
    report = run_modcli("eval", "run", "--data", "corpus.txt")
    old = expected("eval.json")
    assert report["step"] == old["step"] and report["tokens"] == old["tokens"]
    assert [r["routing"] for r in report["results"]] == [r["routing"] for r in old["results"]]
    for now, before in zip(report["results"], old["results"], strict=True):
        assert now["causal"] == before["causal"]
        assert now["loss"] == pytest.approx(before["loss"], abs=1e-6), now["routing"]
        assert now["processed_fraction"] == before["processed_fraction"], now["routing"]


def test_generate_gives_the_same_greedy_tokens(legacy):
    generated = run_modcli("generate", "run", "--prompt", PROMPT, "--max-new-tokens", MAX_NEW_TOKENS,
                           "--temperature", "0")
    old = expected("gen.json")
    assert generated["tokens"] == old["tokens"]
    assert generated["processed_fraction"] == pytest.approx(old["processed_fraction"])


def test_the_runtime_gives_the_same_greedy_tokens_from_the_old_bundle(legacy, capsys):
    from modcli_runtime.cli import main

    main(["bundle", "--prompt", PROMPT, "--max-new-tokens", MAX_NEW_TOKENS, "--temperature", "0", "--json"])
    generated = json.loads(capsys.readouterr().out)
    old = expected("rungen.json")
    assert generated["tokens"] == old["tokens"]
    assert generated["processed_fraction"] == pytest.approx(old["processed_fraction"])


def test_load_model_reads_the_old_run_and_predicts_the_same_first_token(legacy):
    model = modcli.load_model(legacy / "run")
    assert not model.training
    prompt = torch.tensor([list(PROMPT.encode())])  # (1, T) bytes
    with torch.no_grad():
        logits = model(prompt, routing="router")  # (1, T, vocab)
    assert logits.shape == (1, len(PROMPT), 256)
    assert int(logits[0, -1].argmax()) == expected("gen.json")["tokens"][0][0]
