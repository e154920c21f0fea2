"""The command line through typer's CliRunner: happy paths and every bad-input path with its exit code."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from modcli.cli import app

TINY = ["--d-model", "32", "--n-layers", "4", "--n-heads", "4", "--seq-len", "32", "--batch-size", "4",
        "--eval-batches", "1", "--device", "cpu", "--warmup", "2"]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_help_lists_the_commands(runner):
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("train", "eval", "generate"):
        assert command in result.output


def test_train_json_then_eval_and_generate(runner, tmp_path, corpus_file):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--data", str(corpus_file), "--out", str(out), "--max-steps", "6",
                                 "--eval-every", "3", *TINY, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 6 and summary["val_loss"] > 0 and not summary["dense"]

    result = runner.invoke(app, ["eval", str(out), "--batches", "2", "--batch-size", "2", "--device", "cpu",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["routing"] for r in report["results"]] == ["topk", "router", "predictor"]
    assert [r["causal"] for r in report["results"]] == [False, True, True]
    assert set(report["agreement"]["block1"]) == {"router", "predictor"}

    result = runner.invoke(app, ["eval", str(out), "--batches", "1", "--device", "cpu"])
    assert result.exit_code == 0 and "non-causal" in result.stdout

    result = runner.invoke(app, ["generate", str(out), "--prompt", "def ", "--max-new-tokens", "20",
                                 "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    generated = json.loads(result.stdout)
    assert generated["new_tokens"] == 20 and generated["kv_cache_bytes"] < generated["dense_kv_cache_bytes"]

    result = runner.invoke(app, ["generate", str(out), "--prompt", "def ", "--max-new-tokens", "5",
                                 "--device", "cpu"])
    assert result.exit_code == 0 and result.stdout.startswith("def ")
    assert "KV cache" in result.stderr and "tokens/s" in result.stderr


def test_config_file_is_read_and_flags_win(runner, tmp_path, corpus_file):
    config = tmp_path / "run.toml"
    config.write_text('[model]\nd-model = 32\nn_heads = 4\nn_layers = 2\nseq_len = 32\n'
                      '[train]\nmax_steps = 4\nbatch_size = 2\neval_every = 2\neval_batches = 1\n')
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--config", str(config), "--data", str(corpus_file), "--out", str(out),
                                 "--max-steps", "3", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 3
    saved = json.loads((out / "step-00000003" / "config.json").read_text())
    assert saved["model"]["n_layers"] == 2 and saved["train"]["batch_size"] == 2


def test_resume_continues_a_finished_run_with_more_steps(runner, tmp_path, corpus_file):
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus_file), "--out", str(out), "--eval-every", "2", *TINY]
    assert runner.invoke(app, [*args, "--max-steps", "2"]).exit_code == 0
    result = runner.invoke(app, ["train", "--out", str(out), "--resume", "--max-steps", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 4


def _bad(tmp_path, corpus_file, trained_run, trained_dense_run):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("capacity = [")
    unknown_toml = tmp_path / "unknown.toml"
    unknown_toml.write_text("wingspan = 3\n")
    not_a_checkpoint = tmp_path / "folder"
    not_a_checkpoint.mkdir()
    list_config = tmp_path / "hf"  # a model folder whose config.json is a list (an AttributeError before)
    list_config.mkdir()
    (list_config / "config.json").write_text("[1, 2]")
    train = ["train", "--device", "cpu", "--out", str(tmp_path / "out")]
    return [
        ([*train, "--capacity", "1.5"], "--capacity must be in (0, 1]"),
        ([*train, "--n-heads", "5"], "divisible by --n-heads"),
        ([*train, "--preset", "huge"], "--preset must be one of"),
        ([*train, "--data", str(tmp_path / "nope.txt")], "no such file"),
        ([*train, "--data", str(short)], "corpus too short"),
        ([*train, "--config", str(tmp_path / "nope.toml")], "--config: no such file"),
        ([*train, "--config", str(bad_toml)], "not valid TOML"),
        ([*train, "--config", str(unknown_toml)], "unknown option 'wingspan'"),
        ([*train, "--resume"], "no complete checkpoint"),
        ([*train, "--device", "cuda"], "no CUDA device"),
        ([*train, "--dtype", "float8"], "--dtype must be one of"),
        (["train", "--data", str(corpus_file), "--out", str(trained_run), *TINY], "already holds checkpoints"),
        (["eval", str(tmp_path / "missing")], "no such checkpoint"),
        (["eval", str(not_a_checkpoint)], "not a modcli checkpoint"),
        (["eval", str(corpus_file)], "not a modcli checkpoint"),
        (["eval", str(trained_run), "--routing", "sideways"], "--routing sideways: the topk router offers topk, router"),
        (["eval", str(trained_run), "--batches", "0"], "--batches must be >= 1"),
        (["generate", str(trained_run), "--routing", "topk"], "topk is not causal: it sees the future"),
        (["generate", str(trained_run), "--prompt", ""], "--prompt must not be empty"),
        (["generate", str(trained_run), "--top-p", "0"], "--top-p must be in"),
        (["generate", str(tmp_path / "missing")], "no such checkpoint"),
        (["generate", str(trained_run), "--prompt", "abc\udcff\udcfe"], "--prompt is not valid UTF-8 text (byte 0xff"),
        (["generate", str(trained_run), "--max-new-tokens", str(2**63)], "--max-new-tokens must be in 1..2147483647"),
        (["import", str(list_config), "--out", str(tmp_path / "imported")], "config.json: must hold a JSON object"),
    ]


def test_every_bad_input_is_one_line_and_exit_2(runner, tmp_path, corpus_file, trained_run, trained_dense_run):
    for args, message in _bad(tmp_path, corpus_file, trained_run, trained_dense_run):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.output
        assert result.stderr.strip().count("\n") == 0, result.stderr  # one line
    assert (trained_run / "step-00000030" / "COMPLETE").exists()  # nothing saved was lost


def test_incomplete_checkpoint_is_named_as_such(runner, tmp_path):
    broken = tmp_path / "step-00000005"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"")
    result = runner.invoke(app, ["eval", str(broken)])
    assert result.exit_code == 2 and "incomplete checkpoint" in result.stderr


def test_predictor_routing_needs_a_predictor(runner, tmp_path, corpus_file):
    out = tmp_path / "nopred"
    result = runner.invoke(app, ["train", "--data", str(corpus_file), "--out", str(out), "--max-steps", "2",
                                 "--eval-every", "2", "--predictor-hidden", "0", *TINY])
    assert result.exit_code == 0, result.output
    for args in (["eval", str(out), "--routing", "predictor"], ["generate", str(out), "--routing", "predictor"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "this model has no predictor" in result.stderr


def test_eval_of_a_dense_model_reports_one_causal_row(runner, trained_dense_run):
    result = runner.invoke(app, ["eval", str(trained_dense_run), "--batches", "1", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert [(r["routing"], r["causal"]) for r in rows] == [("dense", True)]
    assert rows[0]["processed_fraction"] == {}
