"""`modcli tokenizer train`: a byte-level BPE tokenizer.json learned from a corpus' training split.

The file is written beside --out and renamed into place under --out's lock (modcli.checkpoint.lock, the one every
writing command takes): never over a file that exists, even one that appeared while the tokenizer trained."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from modcli.checkpoint import atomic
from modcli.checkpoint.lock import OutLock
from modcli.config import DataConfig
from modcli.data.corpus import load_corpus
from modcli.errors import UserError, WriteFailed


@dataclass
class TokenizerTrainConfig:
    """What `modcli tokenizer train` learns from and writes."""

    vocab_size: int = 4096
    """Tokens in the vocabulary, the 256 byte tokens included."""
    data: str | None = None
    """A text file or folder; None = the built-in corpus."""
    glob: str = "**/*"
    """File pattern when --data is a folder."""
    max_bytes: int = 50_000_000
    """At most this many bytes of the training split are used."""
    out: str = "tokenizer.json"
    """The tokenizer.json to write (refused if it exists)."""

    def __post_init__(self) -> None:
        if not 257 <= self.vocab_size <= 2**32:
            raise UserError(f"--vocab-size must be in [257, 2**32], got {self.vocab_size}")
        if self.max_bytes < 1:
            raise UserError(f"--max-bytes must be >= 1, got {self.max_bytes}")


@dataclass
class TokenizerTrainResult:
    out: str
    vocab_size: int
    bytes: int
    corpus: str
    bytes_per_token: float
    """Bytes per token of the validation split: how much the tokenizer compresses unseen text."""


def train_tokenizer(config: TokenizerTrainConfig) -> TokenizerTrainResult:
    """A byte-level BPE (every byte is a token, so any text encodes) trained on the corpus' training split."""
    out = Path(config.out)
    with OutLock(out, "tokenizer train"):
        if os.path.lexists(out):
            raise UserError(f"--out {out} exists; pick another path")
        return _train(config, out)


def _train(config: TokenizerTrainConfig, out: Path) -> TokenizerTrainResult:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    corpus = load_corpus(DataConfig(data=config.data, glob=config.glob), seq_len=2)
    raw = bytes(corpus.train[:config.max_bytes])
    lines = raw.decode("utf-8", errors="replace").splitlines(keepends=True)
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=config.vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(lines, trainer, length=len(lines))
    try:
        with atomic.publish_file(out) as tmp:
            tokenizer.save(str(tmp))
    except OSError as exc:
        raise WriteFailed(f"cannot write {out}: {exc.strerror or exc}") from None
    except Exception as exc:  # the tokenizers library reports a refused write as its own exception
        if isinstance(exc, UserError) or "os error" not in str(exc).lower():
            raise
        raise WriteFailed(f"cannot write {out}: {' '.join(str(exc).split())[:300]}") from None
    validation = bytes(corpus.val[:1_000_000]).decode("utf-8", errors="replace")
    n_tokens = max(1, len(tokenizer.encode(validation).ids))
    return TokenizerTrainResult(str(out), tokenizer.get_vocab_size(), len(raw), corpus.description,
                                len(validation.encode("utf-8")) / n_tokens)
