"""Data: the built-in corpus (the Python standard library's sources), user text, and batches.

Every corpus ends up as two token arrays (train and validation) memory-mapped from disk. With the default
tokenizer bytes are tokens (uint8): nothing to download. Folders are concatenated once into a cache file under
$MODCLI_CACHE (default ~/.cache/modcli) and reused. A run with a tokenizer.json (`modcli import`) tokenizes each
byte split once into a cached uint16 (or uint32, for vocabularies over 65,536) file, keyed by the split and the
tokenizer's contents.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from modcli_runtime.text import JsonTokenizer, Tokenizer

from modcli.checkpoint import atomic
from modcli.config import DataConfig
from modcli.errors import ReportedError, UserError, WriteFailed

TOKENIZE_CHUNK_BYTES = 1 << 20
"""Text is tokenized in pieces of about this size, cut at line ends."""

FILE_SEPARATOR = b"\n\n"
BINARY_SNIFF_BYTES = 8192
"""A text file has no NUL byte in its first this many bytes (git's rule); .bin files are token files, not text."""


def cache_dir() -> Path:
    return Path(os.environ.get("MODCLI_CACHE") or Path.home() / ".cache" / "modcli")


def _write_cache(path: Path, chunks: list[bytes]) -> None:
    """Write one cache file atomically (`atomic.write_file`: nothing half-written is left, not even its temporary
    file). A disk that refuses it (full, read-only, no permission) is a WriteFailed, exit code 1: not the user's
    mistake, and no --data names it. No fallback to an uncached corpus: the splits are memory-mapped from these
    files (a folder corpus can be larger than memory), and a full disk would stop a run at its first checkpoint."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # what a killed writer left (its process is gone)
        pid = stale.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    try:
        atomic.write_file(path, chunks)
    except OSError as exc:
        raise WriteFailed(f"cannot write the corpus cache {path}: {exc.strerror or exc} (free some space, or set "
                          "MODCLI_CACHE to a folder on another disk)") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _is_validation(relative_path: str, val_fraction: float) -> bool:
    """Deterministic split by file: a hash of the relative path, the same on every machine."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < val_fraction


def _memmap(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def _folder_split(root: Path, files: list[Path], val_fraction: float, tag: str) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate files (sorted by relative path) into cached train/val .bin files, split by file hash."""
    files = sorted(files, key=lambda f: f.relative_to(root).as_posix())
    fingerprint = hashlib.sha256(repr(val_fraction).encode())
    for f in files:
        stat = f.stat()
        fingerprint.update(f"{f.relative_to(root).as_posix()}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    base = cache_dir() / f"{tag}-{fingerprint.hexdigest()[:16]}"
    train_path, val_path = base.with_suffix(".train.bin"), base.with_suffix(".val.bin")
    if not (train_path.exists() and val_path.exists()):
        train_chunks: list[bytes] = []
        val_chunks: list[bytes] = []
        for f in files:
            chunks = val_chunks if _is_validation(f.relative_to(root).as_posix(), val_fraction) else train_chunks
            chunks += [f.read_bytes(), FILE_SEPARATOR]
        _write_cache(val_path, val_chunks)
        _write_cache(train_path, train_chunks)
    return _memmap(train_path), _memmap(val_path)


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's .py sources (no site-packages): on every machine that runs Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file()]
    return root, files


@dataclass
class Corpus:
    """Train and validation token arrays (bytes, or a tokenizer's ids) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    description: str
    bytes_per_token: float = 1.0
    """UTF-8 bytes per token of the validation split (1 for bytes): turns a loss per token into bits per byte."""


def load_corpus(config: DataConfig, seq_len: int, tokenizer: Tokenizer | None = None) -> Corpus:
    """Read the corpus named by `config` (tokenized with `tokenizer` when it is a tokenizer.json) and check both
    splits hold at least one window of seq_len + 1 tokens."""
    tokenized = isinstance(tokenizer, JsonTokenizer)
    # A single file's validation tail is cut in bytes: with a tokenizer, leave room for about 4 bytes per token.
    corpus = _byte_corpus(config, 4 * seq_len if tokenized else seq_len)
    if tokenized:
        if config.data is not None and Path(config.data).suffix == ".bin":
            raise UserError("--data: a .bin holds byte tokens; a run with a tokenizer.json reads text files")
        val = _tokenized(corpus.val, tokenizer)
        corpus = Corpus(_tokenized(corpus.train, tokenizer), val,
                        f"{corpus.description}, tokenized with {Path(tokenizer.name).name}",
                        len(corpus.val) / max(1, len(val)))
    total = len(corpus.train) + len(corpus.val)
    for name, split in (("training", corpus.train), ("validation", corpus.val)):
        if len(split) < seq_len + 1:
            raise UserError(
                f"--data: corpus too short: the {name} split has {len(split)} tokens, needs at least "
                f"seq_len + 1 = {seq_len + 1} (the whole corpus has {total})"
            )
    return corpus


def _tokenized(text: np.ndarray, tokenizer: JsonTokenizer) -> np.ndarray:
    """A byte split -> its tokens, cached (uint16, or uint32 for large vocabularies) under $MODCLI_CACHE."""
    fingerprint = hashlib.sha256(Path(tokenizer.name).read_bytes())
    fingerprint.update(str(len(text)).encode())
    fingerprint.update(hashlib.sha256(np.ascontiguousarray(text).tobytes()).digest())
    vocab = tokenizer.tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    path = cache_dir() / f"tokens-{fingerprint.hexdigest()[:20]}.{np.dtype(dtype).name}.bin"
    if not path.exists():
        raw = np.asarray(text).tobytes()
        pieces, start = [], 0
        while start < len(raw):  # cut at line ends so that no token straddles two pieces
            end = raw.find(b"\n", start + TOKENIZE_CHUNK_BYTES)
            end = len(raw) if end < 0 else end + 1
            pieces.append(raw[start:end].decode("utf-8", errors="replace"))
            start = end
        encoded = tokenizer.tokenizer.encode_batch(pieces, add_special_tokens=False) if pieces else []
        ids = np.concatenate([np.asarray(e.ids, dtype=dtype) for e in encoded]) if encoded else np.zeros(0, dtype)
        _write_cache(path, [ids.tobytes()])
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _nul_offset(path: Path) -> int:
    """Offset of the first NUL byte in the head of `path`, or -1 (text)."""
    with open(path, "rb") as f:
        return f.read(BINARY_SNIFF_BYTES).find(b"\0")


def _byte_corpus(config: DataConfig, seq_len: int) -> Corpus:
    """The byte-level splits of the corpus; `seq_len` only sizes the tail split of a single file. A file that
    cannot be read, an empty or binary file and a folder without text files are UserErrors naming the path."""
    path = Path(config.data) if config.data is not None else None
    try:
        return _read_byte_corpus(config, seq_len)
    except OSError as exc:
        if exc.filename and cache_dir() in Path(exc.filename).parents:
            raise WriteFailed(f"cannot write the corpus cache {exc.filename}: {exc.strerror or exc} (MODCLI_CACHE "
                              "names another folder for it)") from None
        if path is None:  # the built-in corpus: nothing the user named
            raise ReportedError(f"cannot read the built-in corpus (the Python standard library) at "
                                f"{exc.filename or sysconfig.get_paths()['stdlib']}: {exc.strerror or exc}") from None
        raise UserError(f"--data: cannot read {exc.filename or path}: {exc.strerror or exc}") from None


def _read_byte_corpus(config: DataConfig, seq_len: int) -> Corpus:
    if config.data is None:
        root, files = stdlib_files()
        tag = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
        train, val = _folder_split(root, files, config.val_fraction, tag)
        description = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library ({len(files)} files)"
    else:
        path = Path(config.data)
        if not path.exists():
            raise UserError(f"--data: no such file or folder: {path}")
        if path.is_dir():
            if not config.glob.strip():
                raise UserError("--glob must not be empty (e.g. '**/*.py')")
            try:
                files = [f for f in path.glob(config.glob) if f.is_file()]
            except (ValueError, NotImplementedError) as exc:  # pathlib's refusals of a pattern
                raise UserError(f"--glob {config.glob!r}: {exc}") from None
            if not files:
                raise UserError(f"--data: no files match {config.glob!r} in {path}")
            text_files = [f for f in files if _nul_offset(f) < 0]  # a folder may hold images or caches: skip them
            if not text_files:
                raise UserError(f"--data: the {len(files)} files matching {config.glob!r} in {path} are all binary "
                                "(NUL bytes); give text files or --glob")
            skipped = len(files) - len(text_files)
            # Files keep their path inside the folder (a symlink to a file elsewhere is followed, and named and split
            # by where it sits in the folder, not by its target, which may lie outside it)
            root = path.resolve()
            train, val = _folder_split(root, [root / f.relative_to(path) for f in text_files], config.val_fraction,
                                       "folder")
            if len(val) < seq_len + 1 and len(train) > 0:
                # Too few files for a split by file: fall back to the tail of the concatenation.
                train, val = _tail_split(np.concatenate([train, val]), config.val_fraction, seq_len)
            description = f"{path} ({len(text_files)} files" + (f", {skipped} binary skipped)" if skipped else ")")
        else:
            if path.stat().st_size == 0:
                raise UserError(f"--data: {path} is empty")
            if path.suffix != ".bin":
                offset = _nul_offset(path)
                if offset >= 0:
                    raise UserError(f"--data: {path} is not text (a NUL byte at offset {offset}); give a text file, "
                                    "a folder of them, or a .bin of byte tokens")
            train, val = _tail_split(_memmap(path), config.val_fraction, seq_len)
            description = str(path)
    if len(train) + len(val) == 0:
        raise UserError(f"--data: the corpus is empty ({config.data})")
    return Corpus(train, val, description)


def _tail_split(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A single file: the last val_fraction (at least one window) is validation."""
    n_val = max(seq_len + 1, int(len(tokens) * val_fraction), 1)
    if len(tokens) < 2 * (seq_len + 1):
        raise UserError(
            f"--data: corpus too short: {len(tokens)} tokens, needs at least 2 x (seq_len + 1) = {2 * (seq_len + 1)} "
            "for a training and a validation window"
        )
    return tokens[:-n_val], tokens[-n_val:]


class BatchSampler:
    """Random contiguous windows of seq_len + 1 tokens from a seeded generator whose state is checkpointed.

    With several ranks, every rank draws the same global batch (batch_size x world_size windows) and keeps its
    own slice: ranks see different data, deterministic from seed and rank, and the run sees exactly the data
    of a single process with batch_size x world_size, whatever the world size it resumes with.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> inputs (B, T) and targets (B, T) as int64, on the CPU: this rank's slice of the global batch."""
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size * self.world_size)
        starts = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        windows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]  # (B, T+1)
        batch = torch.from_numpy(windows.astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state


def evaluation_batches(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int):
    """Deterministic validation windows, evenly spaced over the split, so evaluations are comparable."""
    n_windows = batch_size * n_batches
    last_start = len(tokens) - seq_len - 1
    starts = np.linspace(0, last_start, num=n_windows).astype(np.int64)
    for i in range(n_batches):
        chunk = starts[i * batch_size:(i + 1) * batch_size]
        windows = torch.from_numpy(tokens[chunk[:, None] + np.arange(seq_len + 1)].astype(np.int64))
        yield windows[:, :-1], windows[:, 1:]
