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


def test_a_symlink_to_a_file_outside_the_folder_is_followed(tmp_path):
    """`--data FOLDER` holding a link to a file elsewhere (`ValueError ... not in the subpath` before): the link is
    read as the file it points to, named and split by its place in the folder; a broken link is skipped."""
    outside = tmp_path / "elsewhere" / "shared.txt"
    outside.parent.mkdir()
    outside.write_text("linked text " * 200)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(20):
        (folder / f"f{i}.txt").write_text(f"document {i} " * 40)
    (folder / "link.txt").symlink_to(outside)
    (folder / "dangling.txt").symlink_to(tmp_path / "nowhere.txt")
    corpus = load_corpus(DataConfig(data=str(folder), glob="*.txt"), seq_len=16)
    assert b"linked text" in bytes(corpus.train[:]) + bytes(corpus.val[:])
    assert "(21 files)" in corpus.description


def test_a_full_disk_under_the_corpus_cache_is_one_line_exit_1_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """MODCLI_CACHE on a full disk, no --data given (the built-in corpus): `error: --data: cannot read None: No space
    left on device`, exit 2, and a `.tmp` file left per try before. Now: one line naming the cache, exit 1 (a full disk
    is not the user's mistake), nothing left in the cache."""
    import errno
    import os

    import torch
    from typer.testing import CliRunner

    from modcli.checkpoint.store import save_checkpoint
    from modcli.cli import app
    from modcli.config import RunConfig, TrainConfig
    from modcli.errors import WriteFailed
    from modcli.models.build import build_model
    from tests.conftest import tiny_model_config

    cache = tmp_path / "cache"
    monkeypatch.setenv("MODCLI_CACHE", str(cache))
    real_fsync = os.fsync

    def full_disk(fd: int) -> None:  # the disk fills while a cache file is written; everything else is unaffected
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(cache)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(20):
        (folder / f"f{i}.txt").write_text(f"document {i} " * 40)
    for _ in range(2):
        with pytest.raises(WriteFailed, match="cannot write the corpus cache .*: No space left on device"):
            load_corpus(DataConfig(data=str(folder), glob="*.txt"), seq_len=16)
        assert list(cache.iterdir()) == []  # no `.NAME.PID.tmp`, however many tries
    run = tmp_path / "run"
    config = tiny_model_config()
    torch.manual_seed(0)
    save_checkpoint(run, 0, build_model(config), None,
                    RunConfig(model=config, data=DataConfig(), train=TrainConfig(out=str(run))), {"step": 0}, keep=1)
    result = CliRunner().invoke(app, ["eval", str(run), "--batches", "1", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: cannot write the corpus cache {cache}") and "--data" not in \
        result.stderr and "No space left on device" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert list(cache.iterdir()) == []
    # a temporary file a killed writer left (its process gone) is removed by the next write of that file
    monkeypatch.setattr(os, "fsync", real_fsync)
    load_corpus(DataConfig(data=str(folder), glob="*.txt"), seq_len=16)
    written = sorted(cache.iterdir())
    written[0].unlink()
    stale = cache / f".{written[0].name}.99999999.tmp"
    stale.write_bytes(b"x" * 100)
    load_corpus(DataConfig(data=str(folder), glob="*.txt"), seq_len=16)
    assert sorted(cache.iterdir()) == written
