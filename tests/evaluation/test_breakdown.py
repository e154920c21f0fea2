"""`modcli eval RUN --against ORIGINAL`: the per-token breakdown of the loss difference."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.errors import UserError
from modcli.evaluation.breakdown import breakdown, check_comparable, token_kind
from modcli.models.build import build_model
from tests.conftest import tiny_model_config

EVAL = ["--batches", "2", "--batch-size", "2", "--device", "cpu", "--json"]


@pytest.mark.parametrize(("text", "kind"), [
    ("    ", "whitespace"), ("\n", "whitespace"), (" return", "word"), ("f_3", "word"), ("42", "digits"),
    (" 7", "digits"), ("):", "punctuation"), (" +=", "punctuation"), ("x1(", "mixed"), (" a.b", "mixed"),
])
def test_token_kinds(text, kind):
    assert token_kind(text) == kind


def test_breakdown_by_hand():
    targets = torch.tensor([[1, 2, 1, 3], [3, 3, 2, 1]])  # (N, T)
    against = torch.ones(2, 4)
    losses = against + torch.tensor([[0.0, 1.0, 0.0, 2.0], [2.0, 2.0, 0.0, -1.0]])  # total extra: 6
    spelled = {1: " x", 2: "\n", 3: "("}
    b = breakdown(losses, against, targets, spelled.__getitem__, "orig", "dense", worst=2)
    assert b.tokens == 8 and b.loss == pytest.approx(1.75) and b.against_loss == pytest.approx(1.0)
    assert b.top_shares["1%"] == pytest.approx(2 / 6) and b.top_shares["10%"] == pytest.approx(2 / 6)
    assert b.improved == pytest.approx(1 / 8)
    assert b.kinds["punctuation"].tokens == pytest.approx(3 / 8) and b.kinds["punctuation"].extra == pytest.approx(1)
    assert b.kinds["word"].extra == pytest.approx(-1 / 6) and b.kinds["whitespace"].extra == pytest.approx(1 / 6)
    assert sum(g.extra for g in b.kinds.values()) == pytest.approx(1)
    assert sum(g.extra for g in b.positions.values()) == pytest.approx(1)
    assert b.positions["0-0"].extra == pytest.approx(2 / 6) and b.positions["3-3"].extra == pytest.approx(1 / 6)
    assert [(t.text, t.count, t.delta) for t in b.worst] == [("'('", 3, pytest.approx(2.0)),
                                                            ("'\\n'", 2, pytest.approx(0.5))]


@pytest.fixture(scope="module")
def dropped_run(trained_dense_run, corpus_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("breakdown") / "dropped"
    result = CliRunner().invoke(app, ["train", "--init-from", str(trained_dense_run), "--dense", "--drop",
                                      "attention:1", "--data", str(corpus_file), "--max-steps", "0", "--out", str(out),
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return out


def test_against_the_original_agrees_with_each_models_own_eval(dropped_run, trained_dense_run):
    runner = CliRunner()
    result = runner.invoke(app, ["eval", str(dropped_run), "--against", str(trained_dense_run), *EVAL])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    original = json.loads(runner.invoke(app, ["eval", str(trained_dense_run), *EVAL]).output)
    b = got["breakdown"]
    assert b["loss"] == pytest.approx(got["results"][0]["loss"], abs=1e-5)  # the same windows, the same mode
    assert b["against_loss"] == pytest.approx(original["results"][0]["loss"], abs=1e-5)
    assert sum(g["extra"] for g in b["kinds"].values()) == pytest.approx(1, abs=1e-6)
    assert len(b["positions"]) == 4 and b["worst"]
    table = runner.invoke(app, ["eval", str(dropped_run), "--against", str(trained_dense_run), *EVAL[:-1]])
    assert table.exit_code == 0 and "the worst 1% of tokens carry" in table.output
    same = json.loads(runner.invoke(app, ["eval", str(trained_dense_run), "--against", str(trained_dense_run),
                                          *EVAL]).output)["breakdown"]
    assert same["loss"] == same["against_loss"] and same["improved"] == 0  # against itself: no difference


def test_a_missing_original_is_one_line(trained_dense_run, tmp_path):
    result = CliRunner().invoke(app, ["eval", str(trained_dense_run), "--against", str(tmp_path / "missing"), *EVAL])
    assert result.exit_code == 2, result.output
    assert "missing" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_an_original_with_other_tokens_is_refused():
    model, other = build_model(tiny_model_config()), build_model(tiny_model_config(vocab_size=300))
    check_comparable(model, build_model(tiny_model_config()), "bytes", "bytes", "ORIG")
    with pytest.raises(UserError, match="--against ORIG: its tokenizer"):
        check_comparable(model, other, "bytes", "bytes", "ORIG")
    with pytest.raises(UserError, match="--against ORIG: its tokenizer"):
        check_comparable(model, model, "bytes", "tokenizer.json", "ORIG")


def test_against_with_tasks_is_one_line(trained_dense_run):
    result = CliRunner().invoke(app, ["eval", str(trained_dense_run), "--tasks", "x", "--against",
                                      str(trained_dense_run)])
    assert result.exit_code == 2 and "--against applies to the perplexity evaluation" in result.output
