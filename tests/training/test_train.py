"""Training: the loss falls, checkpoints round-trip, resume equals the uninterrupted run, failures are safe."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modcli.checkpoint.store import complete_checkpoints, load_model_from, resolve_checkpoint
from modcli.errors import TrainingDiverged, UserError
from modcli.models.flops import training_flops
from modcli.training.loop import train
from modcli.training.schedule import learning_rate
from tests.conftest import tiny_run_config


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_weights(checkpoint: Path, reference: Path, atol: float = 1e-6) -> None:
    got, want = load_file(checkpoint / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_training_lowers_the_loss_and_writes_metrics_and_checkpoints(trained_run):
    records = _metrics(trained_run)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    for key in ("step", "loss", "lr", "tokens", "flops", "elapsed_s", "tokens_per_s"):
        assert key in records[-1]
    assert "val_loss" in records[9] and "val_loss" not in records[8]
    routing = records[-1]["routing"]
    assert set(routing) == {"block1", "block3"} and set(routing["block1"]) == {"router", "predictor"}
    assert [p.name for p in complete_checkpoints(trained_run)] == ["step-00000010", "step-00000020", "step-00000030"]
    checkpoint = resolve_checkpoint(trained_run)
    assert {p.name for p in checkpoint.iterdir()} == {"model.safetensors", "optimizer.pt", "config.json",
                                                      "state.json", "COMPLETE"}
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["step"] == 30 and state["tokens"] == 30 * 4 * 32


VALIDATION_KEYS = {"val_loss", "val_bits_per_byte", "val_loss_router", "val_loss_predictor", "val_loss_topk"}


def test_validation_metrics_hold_the_causal_loss_and_label_the_top_k_one(trained_run, trained_dense_run):
    from modcli.training.objective import bits_per_byte

    records = _metrics(trained_run)
    evaluated = records[9]
    assert VALIDATION_KEYS <= set(evaluated) and not VALIDATION_KEYS & set(records[8])
    assert evaluated["val_loss"] == evaluated["val_loss_router"]  # the honest number is the causal one
    assert evaluated["val_bits_per_byte"] == pytest.approx(bits_per_byte(evaluated["val_loss_router"]))
    assert evaluated["val_loss_topk"] != evaluated["val_loss_router"]
    dense = _metrics(trained_dense_run)[-1]
    assert {key for key in dense if key.startswith("val_")} == {"val_loss", "val_bits_per_byte"}


def _table_rows(output: str) -> list[str]:
    return [" ".join(line.strip("│┃ ").split()) for line in output.splitlines()]


def test_train_summary_lists_the_causal_loss_before_the_top_k_one(tmp_path, corpus_file):
    from typer.testing import CliRunner

    from modcli.cli import app

    runner, wide = CliRunner(), {"COLUMNS": "200"}
    tiny = ["--data", str(corpus_file), "--d-model", "32", "--n-layers", "4", "--n-heads", "4", "--seq-len", "32",
            "--batch-size", "2", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1", "--warmup", "1",
            "--device", "cpu"]
    mod = tmp_path / "mod"
    result = runner.invoke(app, ["train", *tiny, "--out", str(mod)], env=wide)
    assert result.exit_code == 0, result.output
    rows = _table_rows(result.stdout)
    labels = ["validation loss (causal, router)", "validation bits/byte (causal, router)",
              "validation loss (predictor, causal)", "validation loss (topk, non-causal reference)"]
    where = [next(i for i, row in enumerate(rows) if row.startswith(label + " ")) for label in labels]
    assert where == sorted(where), rows

    # Resumed at its end, the run evaluates again: the JSON summary carries the same labelled losses.
    result = runner.invoke(app, ["train", "--out", str(mod), "--resume", "--json"], env=wide)
    assert result.exit_code == 0, result.output
    summary, last = json.loads(result.stdout), _metrics(mod)[-1]
    assert (summary["val_loss"], summary["val_bits_per_byte"]) == (last["val_loss"], last["val_bits_per_byte"])
    assert {f"val_loss_{mode}": loss for mode, loss in summary["val_losses"].items()} == {
        key: last[key] for key in VALIDATION_KEYS - {"val_loss", "val_bits_per_byte"}}
    assert summary["val_routing"] == "router"
    assert summary["val_causal"] == {"router": True, "predictor": True, "topk": False}

    dense = tmp_path / "dense"
    result = runner.invoke(app, ["train", *tiny, "--dense", "--out", str(dense)], env=wide)
    assert result.exit_code == 0, result.output
    assert any(row.startswith("validation loss ") for row in _table_rows(result.stdout))
    assert "causal" not in result.stdout and "top-k" not in result.stdout
    result = runner.invoke(app, ["train", "--out", str(dense), "--resume", "--json"], env=wide)
    summary = json.loads(result.stdout)
    assert summary["val_loss"] > 0 and summary["val_losses"] == {} and summary["val_routing"] == "dense"


def test_checkpoint_round_trip_gives_the_same_logits(trained_run, tmp_path):
    from modcli import load_model

    model = load_model(trained_run)
    tokens = torch.randint(0, 256, (2, 32))
    again, _, _ = load_model_from(resolve_checkpoint(trained_run))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, "router"), again(tokens, "router"), atol=0, rtol=0)
    assert model.head.weight is model.embed.weight  # tied weights survive safetensors


def _start_training(out: Path, corpus: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "modcli", "train", "--data", str(corpus), "--out", str(out), "--device", "cpu",
           "--d-model", "32", "--n-layers", "4", "--n-heads", "4", "--seq-len", "32", "--batch-size", "4",
           "--max-steps", "300", "--eval-every", "20", "--eval-batches", "1", "--warmup", "5", "--keep", "2",
           "--dropout", "0.1", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


@pytest.mark.slow
def test_resume_after_a_kill_reproduces_the_uninterrupted_run(tmp_path, corpus_file):
    killed = tmp_path / "killed"
    process = _start_training(killed, corpus_file, [])
    deadline = time.time() + 120
    while not (killed / "step-00000040" / "COMPLETE").exists():
        assert process.poll() is None, process.stderr.read().decode()
        assert time.time() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "step-00000300").exists(), "the run finished before it could be killed"
    resumed = _start_training(killed, corpus_file, ["--resume"])
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()
    reference = tmp_path / "reference"
    uninterrupted = _start_training(reference, corpus_file, [])
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read().decode()
    got = [(r["step"], r["loss"], r.get("val_loss")) for r in _metrics(killed)]
    want = [(r["step"], r["loss"], r.get("val_loss")) for r in _metrics(reference)]
    assert [s for s, _, _ in got] == list(range(1, 301))
    for (step, loss, val), (_, ref_loss, ref_val) in zip(got, want, strict=True):
        assert math.isclose(loss, ref_loss, rel_tol=0, abs_tol=1e-5), f"step {step}: {loss} != {ref_loss}"
        assert (val is None) == (ref_val is None)
    assert len(complete_checkpoints(killed)) == 2  # --keep 2
    _assert_same_weights(killed / "step-00000300", reference / "step-00000300")


def _dropout_config(corpus: Path, out: Path, **train_overrides):
    config = tiny_run_config(corpus, out, max_steps=20, eval_every=10, eval_batches=1, **train_overrides)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.1))


def test_resume_with_dropout_reproduces_the_uninterrupted_run(tmp_path, corpus_file):
    reference = tmp_path / "reference"
    train(_dropout_config(corpus_file, reference), quiet=True)
    state = json.loads((reference / "step-00000010" / "state.json").read_text())
    assert len(state["rng"]["ranks"]) == 1 and state["grad_scaler"] == {}  # float32: the scaler is off
    want = [(r["step"], r["loss"], r.get("val_loss")) for r in _metrics(reference)]
    for name in ("resumed", "old-state-json"):
        copy = tmp_path / name
        shutil.copytree(reference, copy)
        shutil.rmtree(copy / "step-00000020")
        if name == "old-state-json":  # written before per-rank states: rank 0's CPU RNG state only
            state_path = copy / "step-00000010" / "state.json"
            old = {**state, "rng": {"torch": state["rng"]["ranks"][0]["torch"]}}
            del old["grad_scaler"]
            state_path.write_text(json.dumps(old))
        train(_dropout_config(corpus_file, copy, resume=True), quiet=True)
        _assert_same_weights(copy / "step-00000020", reference / "step-00000020")
        got = [(r["step"], r["loss"], r.get("val_loss")) for r in _metrics(copy)]
        assert [g[0] for g in got] == [w[0] for w in want] == list(range(1, 21))
        for (step, loss, val), (_, ref_loss, ref_val) in zip(got, want, strict=True):
            assert loss == pytest.approx(ref_loss, abs=1e-6), f"{name} step {step}"
            assert (val is None) == (ref_val is None) and (val is None or val == pytest.approx(ref_val, abs=1e-6))


def test_rng_and_grad_scaler_states_round_trip_through_state_json():
    from modcli.training.distributed import DistributedContext
    from modcli.training.resume import gather_resume_state, restore_resume_state

    context = DistributedContext()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3, enabled=True)
    scaler.scale(torch.ones(()))  # the scale tensor is created lazily
    scaler.update(new_scale=256.0)
    torch.manual_seed(123)
    torch.rand(7)
    saved = json.loads(json.dumps(gather_resume_state(scaler, context)))  # what state.json holds
    expected = torch.rand(5)

    torch.manual_seed(0)
    fresh = torch.amp.GradScaler("cpu", enabled=True)
    assert restore_resume_state(saved, fresh, context, dropout=0.1) is None
    assert torch.equal(torch.rand(5), expected)
    assert fresh.state_dict() == scaler.state_dict() and fresh.get_scale() == 256.0

    disabled = torch.amp.GradScaler("cpu", enabled=False)  # float32 after float16: the saved scale is unused
    restore_resume_state(saved, disabled, context, dropout=0.1)
    assert disabled.state_dict() == {}
    empty = torch.amp.GradScaler("cpu", enabled=True)  # float16 after float32: a fresh scaler
    restore_resume_state({**saved, "grad_scaler": {}}, empty, context, dropout=0.1)
    assert empty.get_scale() == 65536.0

    torch.manual_seed(0)
    note = restore_resume_state({**saved, "world_size": 2}, fresh, context, dropout=0.1)
    assert "world size 2 and resumes with world size 1" in note and "dropout randomness differs" in note
    assert not torch.equal(torch.rand(5), expected)  # another world size keeps the fresh seed
    assert restore_resume_state({**saved, "world_size": 2}, fresh, context, dropout=0.0) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_state_round_trips_through_state_json():
    from modcli.training.distributed import DistributedContext
    from modcli.training.resume import gather_resume_state, restore_resume_state

    context = DistributedContext(device=torch.device("cuda", torch.cuda.current_device()))
    scaler = torch.amp.GradScaler("cuda", enabled=True)
    torch.manual_seed(123)
    saved = json.loads(json.dumps(gather_resume_state(scaler, context)))
    assert "cuda" in saved["rng"]["ranks"][0]
    expected = torch.rand(5, device="cuda")
    torch.manual_seed(0)
    restore_resume_state(saved, scaler, context, dropout=0.1)
    assert torch.equal(torch.rand(5, device="cuda"), expected)


def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path, corpus_file, monkeypatch):
    import modcli.checkpoint.store as checkpoint

    out = tmp_path / "run"
    real_save = checkpoint.save_model
    calls = {"n": 0}

    def crash_on_second_save(model, filename):
        calls["n"] += 1
        if calls["n"] == 2:
            Path(filename).write_bytes(b"half a file")
            raise KeyboardInterrupt("killed during save")
        real_save(model, filename)

    monkeypatch.setattr(checkpoint, "save_model", crash_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run_config(corpus_file, out, max_steps=20, eval_every=10), quiet=True)
    assert resolve_checkpoint(out).name == "step-00000010"
    load_model_from(out)


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(tmp_path, corpus_file, monkeypatch):
    import modcli.training.objective as objective_module

    real_loss = objective_module.lm_loss
    calls = {"n": 0}

    def loss_that_explodes(logits, targets):
        calls["n"] += torch.is_grad_enabled()  # count training steps, not validation batches
        loss = real_loss(logits, targets)
        return loss * float("nan") if calls["n"] == 13 else loss

    monkeypatch.setattr(objective_module, "lm_loss", loss_that_explodes)
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match="step 13.*step-00000010"):
        train(tiny_run_config(corpus_file, out, max_steps=20, eval_every=10), quiet=True)
    assert resolve_checkpoint(out).name == "step-00000010"


def test_flops_budget_stops_training(tmp_path, corpus_file):
    config = tiny_run_config(corpus_file, tmp_path / "run", max_steps=1000, eval_every=100)
    per_step = training_flops(config.model, config.model.seq_len) * config.train.batch_size
    config.train.flops_budget = per_step * 7.5
    result = train(config, quiet=True)
    assert result.steps == 8 and result.flops >= config.train.flops_budget


def test_refuses_to_overwrite_a_run_without_resume(trained_run, tmp_path, corpus_file):
    with pytest.raises(UserError, match="already holds checkpoints"):
        train(tiny_run_config(corpus_file, trained_run), quiet=True)
    with pytest.raises(UserError, match="no complete checkpoint"):
        train(tiny_run_config(corpus_file, tmp_path / "new", resume=True), quiet=True)


def test_resume_with_a_different_model_is_refused(trained_run, corpus_file):
    import dataclasses

    config = tiny_run_config(corpus_file, trained_run, resume=True)
    config.model = dataclasses.replace(config.model, capacity=0.5)
    with pytest.raises(UserError, match="--capacity"):
        train(config, quiet=True)


def test_learning_rate_schedule_warms_up_then_decays():
    from modcli.config import TrainConfig

    config = TrainConfig(lr=1.0, warmup=10, max_steps=100, min_lr_ratio=0.1)
    assert learning_rate(5, 100, config) == pytest.approx(0.5)
    assert learning_rate(10, 100, config) == pytest.approx(1.0)
    assert learning_rate(100, 100, config) == pytest.approx(0.1)
    assert learning_rate(55, 100, config) == pytest.approx(0.55)


def _two_step_run(tmp_path: Path, corpus_file: Path) -> tuple[Path, list[str]]:
    from typer.testing import CliRunner

    from modcli.cli import app

    run = tmp_path / "run"
    args = ["train", "--data", str(corpus_file), "--out", str(run), "--d-model", "32", "--n-layers", "2",
            "--n-heads", "2", "--seq-len", "32", "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1",
            "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--max-steps", "2"])
    assert result.exit_code == 0, result.output
    return run, args


def test_resume_drops_a_last_metrics_line_cut_short_by_a_kill_with_a_note(tmp_path, corpus_file):
    from typer.testing import CliRunner

    from modcli.cli import app

    run, args = _two_step_run(tmp_path, corpus_file)
    path = run / "metrics.jsonl"
    torn = len(path.read_text().splitlines()) + 1
    with path.open("a") as log:
        log.write('{"step": 3, "loss": 2.')  # what a kill in the middle of a write leaves
    result = CliRunner().invoke(app, [*args, "--resume", "--max-steps", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert f"note: {path}: its last line, line {torn}, was cut short" in " ".join(result.stderr.split())
    assert json.loads(result.stdout)["steps"] == 4
    assert [r["step"] for r in _metrics(run) if "loss" in r] == [1, 2, 3, 4]


def test_resume_refuses_a_damaged_metrics_line_before_the_last_naming_it(tmp_path, corpus_file):
    from typer.testing import CliRunner

    from modcli.cli import app

    run, args = _two_step_run(tmp_path, corpus_file)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    before = "\n".join([lines[0], '{"step": 1, "loss": 2.', *lines[1:]]) + "\n"
    path.write_text(before)
    checkpoints = sorted(p.name for p in run.iterdir())
    result = CliRunner().invoke(app, [*args, "--resume", "--max-steps", "4"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"{path}: line 2 is damaged" in " ".join(result.stderr.split())
    assert path.read_text() == before and sorted(p.name for p in run.iterdir()) == checkpoints  # nothing touched


CONFIG_FILES = [
    ('dense = "false"\n', "dense must be true or false, got 'false'"),
    ('preset = "huge"\n', "preset must be one of tiny, small, base, got 'huge'"),
    ("preset = 3\n", "preset must be a string, got 3"),
    ('[model]\ncapacity = "0.5"\n', "capacity must be a finite number, got '0.5'"),
    ("[train]\nmax_steps = 2.5\n", "max_steps must be an integer, got 2.5"),
    ("[train]\ncompile = 1\n", "compile must be true or false, got 1"),
    ("[optimiser]\nlr = 0.1\n", "unknown table [optimiser]"),
]


@pytest.mark.parametrize(("text", "message"), CONFIG_FILES, ids=[m for _, m in CONFIG_FILES])
def test_a_config_file_key_of_the_wrong_type_is_one_line_naming_file_and_key(tmp_path, text, message):
    from typer.testing import CliRunner

    from modcli.cli import app

    config = tmp_path / "run.toml"
    config.write_text(text)
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--device", "cpu", "--out",
                                      str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"--config {config}: {message}" in result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_config_file_preset_applies_as_on_the_command_line_and_flags_win(tmp_path):
    from modcli.config import PRESETS, resolve_run_config

    def resolved(text: str, preset: str | None = None, **flags):
        (tmp_path / "run.toml").write_text(text)
        return resolve_run_config(preset, str(tmp_path / "run.toml"), flags, default_preset="tiny")

    small = resolved('preset = "small"\n')
    assert (small.model.d_model, small.model.n_layers, small.train.max_steps) == (
        PRESETS["small"]["d_model"], PRESETS["small"]["n_layers"], PRESETS["small"]["max_steps"])
    assert resolved('preset = "small"\nn_layers = 2\n', n_layers=3).model.n_layers == 3  # flags win
    assert resolved('preset = "small"\nn_layers = 2\n').model.n_layers == 2  # the file over its preset
    assert resolved('preset = "small"\n', preset="tiny").model.d_model == PRESETS["tiny"]["d_model"]  # --preset wins
    assert resolved("d_model = 64\n").model.d_model == 64  # no preset in the file: the default one
    assert resolved("dense = false\n").model.route_every == 2
    assert resolved("dense = true\n").model.dense
    assert resolved('route_layers = "1,3"\n').model.route_layers == [1, 3]  # the flag's spelling too


def test_train_takes_the_preset_of_its_config_file(tmp_path, corpus_file):
    from typer.testing import CliRunner

    from modcli.cli import app
    from modcli.config import PRESETS

    config = tmp_path / "run.toml"
    config.write_text('preset = "small"\n[model]\nd_model = 32\n')
    result = CliRunner().invoke(app, [
        "train", "--config", str(config), "--data", str(corpus_file), "--n-layers", "2", "--n-heads", "2",
        "--seq-len", "32", "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--eval-batches", "1",
        "--device", "cpu", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    saved = json.loads(next((tmp_path / "run").glob("step-*/config.json")).read_text())
    assert (saved["train"]["lr"], saved["train"]["warmup"]) == (PRESETS["small"]["lr"], PRESETS["small"]["warmup"])
    assert (saved["model"]["d_model"], saved["model"]["n_layers"]) == (32, 2)
