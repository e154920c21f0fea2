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


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_at_load(tmp_path, corpus_file):
    """A run whose tokenizer.json gives ids past the model's vocabulary (a model imported or copied with another
    tokenizer) was an `IndexError: index out of range in self` in generate and eval: now one line naming both sizes,
    exit 2, from every command that loads the run's tokenizer for its model."""
    import importlib.util

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from modcli.checkpoint.store import save_checkpoint
    from modcli.config import DataConfig, RunConfig, TrainConfig
    from modcli.models.build import build_model
    from tests.conftest import tiny_model_config

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([make_corpus_text(50)], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = tiny_model_config(vocab_size=size - 20)
    run = RunConfig(model=config, data=DataConfig(tokenizer="tokenizer.json"), train=TrainConfig(out=str(tmp_path)))
    save_checkpoint(tmp_path, 0, build_model(config), None, run, {"step": 0}, keep=1)
    message = f"has {size} tokens but the model's vocabulary has {size - 20}: ids {size - 20}..{size - 1} have no"
    commands = [["generate", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "2", "--device", "cpu"],
                ["eval", str(tmp_path), "--data", str(corpus_file), "--batches", "1", "--device", "cpu"],
                ["routes", str(tmp_path), "--text", str(corpus_file), "--out", str(tmp_path / "r.html"),
                 "--device", "cpu"]]
    if importlib.util.find_spec("lm_eval") is not None:
        commands.append(["eval", str(tmp_path), "--tasks", "arc_easy", "--device", "cpu"])
    for args in commands:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args[0], result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (args[0], result.stderr)
        assert "Traceback" not in result.output
    assert not (tmp_path / "r.html").exists()
