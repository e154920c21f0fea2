"""Training: the loss falls, checkpoints round-trip, resume equals the uninterrupted run, failures are safe."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from modcli.checkpoint import complete_checkpoints, load_model_from, resolve_checkpoint
from modcli.errors import TrainingDiverged, UserError
from modcli.flops import training_flops
from modcli.training import learning_rate, train
from tests.conftest import tiny_run_config


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


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
           "--max-steps", "300", "--eval-every", "20", "--eval-batches", "1", "--warmup", "5", "--keep", "2", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


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


def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path, corpus_file, monkeypatch):
    import modcli.checkpoint as checkpoint

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
    import modcli.training as train_module

    real_loss = train_module.lm_loss
    calls = {"n": 0}

    def loss_that_explodes(logits, targets):
        calls["n"] += torch.is_grad_enabled()  # count training steps, not validation batches
        loss = real_loss(logits, targets)
        return loss * float("nan") if calls["n"] == 13 else loss

    monkeypatch.setattr(train_module, "lm_loss", loss_that_explodes)
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
