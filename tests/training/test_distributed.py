"""torchrun with 2 CPU processes (Gloo): the same losses as one process with the same global batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # every test here starts worker processes: 5-15 s each

TINY = ["--d-model", "32", "--n-layers", "4", "--n-heads", "4", "--seq-len", "32", "--eval-every", "4",
        "--eval-batches", "1", "--device", "cpu", "--warmup", "2", "--log-every", "2"]


def _run(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "modcli", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone", "-m", "modcli", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)


def _losses(run: Path) -> list[tuple[int, float, float | None]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in records]


def _assert_same_curve(a, b, atol=1e-5):
    assert [s for s, _, _ in a] == [s for s, _, _ in b]
    for (step, loss, val), (_, ref, ref_val) in zip(a, b, strict=True):
        assert loss == pytest.approx(ref, abs=atol), f"step {step}"
        assert (val is None) == (ref_val is None) and (val is None or val == pytest.approx(ref_val, abs=atol))


def _assert_same_weights(checkpoint: Path, reference: Path, atol: float = 1e-6) -> None:
    got, want = load_file(checkpoint / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, corpus_file, parallel):
    common = ["--data", str(corpus_file), "--max-steps", "8", *TINY]
    two = _run([*common, "--batch-size", "2", "--grad-accum", "2", "--parallel", parallel,
                "--out", str(tmp_path / "two"), "--json"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    summary = json.loads(two.stdout)  # only rank 0 prints: exactly one JSON object
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert "global batch 8 = 2 x 2 x 2" in two.stderr
    one = _run([*common, "--batch-size", "4", "--grad-accum", "2", "--out", str(tmp_path / "one")], nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    _assert_same_curve(_losses(tmp_path / "two"), _losses(tmp_path / "one"))

    # The 2-rank checkpoint (a gathered full state dict) resumes in one process with the same global batch.
    resumed = _run(["--out", str(tmp_path / "two"), "--resume", "--max-steps", "12", "--batch-size", "4"], nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(tmp_path / "two")[-1][0] == 12


def test_a_bad_data_path_ends_every_rank_with_one_message(tmp_path):
    result = _run(["--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "run"), *TINY], nproc=2)
    assert result.returncode != 0
    assert result.stderr.count("error: --data: no such file or folder") == 1


def test_two_process_resume_with_dropout_reproduces_the_uninterrupted_run(tmp_path, corpus_file):
    args = ["--data", str(corpus_file), "--max-steps", "8", "--batch-size", "2", "--dropout", "0.1", *TINY]
    reference = tmp_path / "reference"
    uninterrupted = _run([*args, "--out", str(reference)], nproc=2)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    state = json.loads((reference / "step-00000004" / "state.json").read_text())
    assert len(state["rng"]["ranks"]) == 2 and state["rng"]["ranks"][0] != state["rng"]["ranks"][1]

    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "step-00000008")
    again = _run([*args, "--out", str(resumed), "--resume"], nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "dropout randomness differs" not in again.stderr
    _assert_same_curve(_losses(resumed), _losses(reference), atol=1e-6)
    _assert_same_weights(resumed / "step-00000008", reference / "step-00000008")
