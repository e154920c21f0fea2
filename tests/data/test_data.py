"""Corpora and batches: the built-in stdlib corpus, user files and folders, bad input, sampler state."""

from __future__ import annotations

import numpy as np
import pytest

from modcli.config import DataConfig
from modcli.data.corpus import BatchSampler, _is_validation, evaluation_batches, load_corpus, stdlib_files
from modcli.errors import UserError


@pytest.mark.slow
def test_builtin_corpus_is_the_stdlib_split_by_file_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MODCLI_CACHE", str(tmp_path))
    corpus = load_corpus(DataConfig(), seq_len=64)
    root, files = stdlib_files()
    assert len(files) > 500 and "standard library" in corpus.description
    total = sum(f.stat().st_size for f in files)
    assert 0.005 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.06
    assert len(corpus.train) + len(corpus.val) >= total  # separators added
    cached = sorted(p.name for p in tmp_path.iterdir())
    assert len(cached) == 2 and all(name.endswith(".bin") for name in cached)
    again = load_corpus(DataConfig(), seq_len=64)  # reused, not rebuilt
    assert np.array_equal(again.val, corpus.val)


def test_split_by_file_is_deterministic():
    assert _is_validation("json/decoder.py", 0.02) == _is_validation("json/decoder.py", 0.02)
    picked = sum(_is_validation(f"pkg/module_{i}.py", 0.02) for i in range(5000))
    assert 50 < picked < 150


def test_text_file_folder_and_bin(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes(b"hello \xff\xfe non-utf8 bytes are fine " * 50)
    corpus = load_corpus(DataConfig(data=str(text)), seq_len=16)
    assert len(corpus.train) + len(corpus.val) == text.stat().st_size
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for i in range(30):
        (folder / "sub" / f"f{i}.md").write_text(f"document {i} " * 40)
    (folder / "skip.py").write_text("ignored " * 100)
    corpus = load_corpus(DataConfig(data=str(folder), glob="**/*.md"), seq_len=16)
    assert b"ignored" not in bytes(corpus.train[:]) + bytes(corpus.val[:])
    binary = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint8).tofile(binary)
    corpus = load_corpus(DataConfig(data=str(binary)), seq_len=16)
    assert corpus.train[5] == 5


@pytest.mark.parametrize("setup, message", [
    (lambda p: p / "missing.txt", "no such file"),
    (lambda p: (p / "empty.txt").write_text("") and None or p / "empty.txt", "too short|empty"),
    (lambda p: (p / "short.txt").write_text("x" * 20) and None or p / "short.txt", "too short"),
    (lambda p: (p / "emptydir").mkdir() or p / "emptydir", "no files match"),
])
def test_bad_corpora_are_user_errors(tmp_path, setup, message):
    with pytest.raises(UserError, match=message):
        load_corpus(DataConfig(data=str(setup(tmp_path))), seq_len=16)


def test_sampler_windows_and_state_round_trip():
    tokens = np.arange(256, dtype=np.uint8).repeat(4)
    sampler = BatchSampler(tokens, seq_len=8, batch_size=3, seed=1)
    inputs, targets = sampler.next()
    assert inputs.shape == targets.shape == (3, 8)
    assert np.array_equal(inputs[:, 1:].numpy(), targets[:, :-1].numpy())  # targets are inputs shifted by one
    state = sampler.state()
    expected = sampler.next()[0]
    sampler.next()
    sampler.load_state(state)
    assert np.array_equal(sampler.next()[0].numpy(), expected.numpy())


def test_evaluation_batches_are_deterministic_and_cover_the_split():
    tokens = np.arange(200, dtype=np.uint8)
    first = [x for x, _ in evaluation_batches(tokens, 8, 2, 3)]
    second = [x for x, _ in evaluation_batches(tokens, 8, 2, 3)]
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert first[0][0, 0] == 0 and first[-1][-1, -1] == 199 - 1
