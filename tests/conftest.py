"""Shared fixtures: tiny configs, a small generated corpus, and one tiny trained run reused by many tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from modcli.config import DataConfig, ModelConfig, RunConfig, TrainConfig

# Tiny models gain nothing from a second intra-op thread, and on a shared 2-core machine the threads wait for each
# other: one thread ran tests/decode/test_decoding.py, test_moe.py and test_routers.py (not slow) in 9 s, two in 24-42 s.
torch.set_num_threads(1)

# pytest-xdist's workers start with COLUMNS=80, and Rich's consoles (modcli.commands.common, made at import) fix their
# width from it once and for all: a test's own `env={"COLUMNS": ...}` would then change nothing. Without it, a console
# reads the width of the moment, as it does in a serial run.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


def tiny_model_config(**overrides) -> ModelConfig:
    values = dict(d_model=32, n_layers=4, n_heads=4, seq_len=32, capacity=0.25, route_every=2, route_offset=1,
                  predictor_hidden=16)
    values.update(overrides)
    return ModelConfig.of(**values)


def make_corpus_text(n_lines: int = 400) -> str:
    """Deterministic, learnable text with some structure (a little Python-like program)."""
    lines = []
    for i in range(n_lines):
        lines.append(f"def f_{i % 17}(x):\n    return x * {i % 7} + {i % 5}  # line {i}\n")
    return "".join(lines)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Corpus caches go to a per-session temporary folder, never to ~/.cache."""
    monkeypatch.setenv("MODCLI_CACHE", str(tmp_path_factory.getbasetemp() / "modcli-cache"))


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(make_corpus_text())
    return path


def tiny_run_config(corpus: Path, out: Path, **train_overrides) -> RunConfig:
    train = dict(batch_size=4, max_steps=20, eval_every=10, eval_batches=2, warmup=2, lr=3e-3, out=str(out),
                 device="cpu", log_every=5)
    train.update(train_overrides)
    return RunConfig(model=tiny_model_config(), data=DataConfig(data=str(corpus)), train=TrainConfig(**train))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, corpus_file) -> Path:
    """A tiny MoD model trained for a few steps with a predictor (shared, read-only for tests)."""
    from modcli.training.loop import train

    os.environ.setdefault("MODCLI_CACHE", str(tmp_path_factory.getbasetemp() / "modcli-cache"))
    out = tmp_path_factory.mktemp("runs") / "tiny"
    train(tiny_run_config(corpus_file, out, max_steps=30), quiet=True)
    return out


@pytest.fixture(scope="session")
def trained_dense_run(tmp_path_factory, corpus_file) -> Path:
    from modcli.config import RunConfig
    from modcli.training.loop import train

    out = tmp_path_factory.mktemp("runs") / "tiny-dense"
    config = tiny_run_config(corpus_file, out, max_steps=10)
    config = RunConfig(model=config.model.dense_twin(), data=config.data, train=config.train)
    train(config, quiet=True)
    return out


def on_cpu_of(monkeypatch, vendor: str) -> None:
    """Make `modcli.packed_linear` see a CPU of `vendor` (AuthenticAMD: the packed kernel is the default)."""
    from modcli import packed_linear

    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: vendor)


def packed_products(monkeypatch) -> list[int]:
    """Pack every product (a tiny run's weights are too small to pay: `modcli.packed_linear.min_rows`) and count
    the products the packed kernel computes (count[0])."""
    from modcli import packed_linear

    monkeypatch.setattr(packed_linear, "min_rows", lambda elements: 1)
    count = [0]
    packed = torch.ops.mkldnn._linear_pointwise

    def counted(*args):
        count[0] += 1
        return packed(*args)

    monkeypatch.setattr(packed_linear, "_packed_product", counted)
    return count
