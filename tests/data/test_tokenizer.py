"""`modcli tokenizer train` and from-scratch runs with a tokenizer.json: train, eval, generate; bad input exits 2."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from modcli.cli import app
from tests.conftest import make_corpus_text

runner = CliRunner()


def test_a_trained_tokenizer_drives_a_run_from_scratch(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus_text(1500))
    tokenizer = tmp_path / "tok.json"
    result = runner.invoke(app, ["tokenizer", "train", "--data", str(corpus), "--vocab-size", "320", "--out",
                                 str(tokenizer), "--json"])
    assert result.exit_code == 0, result.output
    trained = json.loads(result.stdout)
    assert trained["vocab_size"] == 320 and trained["bytes_per_token"] > 1.5  # it compresses unseen text

    run = tmp_path / "run"
    result = runner.invoke(app, ["train", "--data", str(corpus), "--tokenizer", str(tokenizer), "--vocab-size", "320",
                                 "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32",
                                 "--batch-size", "4", "--max-steps", "4", "--eval-every", "4", "--eval-batches", "1",
                                 "--device", "cpu", "--out", str(run), "--json"])
    assert result.exit_code == 0, result.output
    assert (run / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    config = json.loads(next(run.glob("step-*/config.json")).read_text())
    assert config["data"]["tokenizer"] == "tokenizer.json"
    result = runner.invoke(app, ["generate", str(run), "--prompt", "def f_2(x):", "--max-new-tokens", "5",
                                 "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert all(0 <= t < 320 for t in json.loads(result.stdout)["tokens"][0])
    result = runner.invoke(app, ["eval", str(run), "--batches", "1", "--batch-size", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    (mode, *_) = json.loads(result.stdout)["results"]
    # bits per byte of text, not per token: a token here stands for about 2-3 bytes
    assert mode["bits_per_byte"] < mode["loss"] / math.log(2) / 1.5


def test_tokenizer_bad_input_exits_2(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus_text(200))
    (tmp_path / "taken.json").write_text("{}")
    for args, message in [
        (["tokenizer", "train", "--vocab-size", "100", "--data", str(corpus)], "--vocab-size must be in [257"),
        (["tokenizer", "train", "--data", str(corpus), "--out", str(tmp_path / "taken.json")], "exists"),
        (["tokenizer", "train", "--data", str(tmp_path / "nothing.txt")], "--data: no such file"),
        (["train", "--data", str(corpus), "--tokenizer", str(tmp_path / "missing.json"), "--out",
          str(tmp_path / "run")], "--tokenizer: no such file"),
        (["train", "--data", str(corpus), "--tokenizer", str(tmp_path / "taken.json"), "--out",
          str(tmp_path / "run2")], "not a readable tokenizer.json"),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr, (args, result.stderr)
