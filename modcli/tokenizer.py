"""Tokenizers: bytes (the default: token = byte, vocabulary 256) or a Hugging Face `tokenizer.json` read with the
`tokenizers` library (imported runs, `modcli import`). A run names its tokenizer in `DataConfig.tokenizer`:
"bytes", or the path of a tokenizer.json relative to the run folder (or absolute).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from modcli.errors import UserError

BYTES = "bytes"


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token = byte of the UTF-8 text (vocabulary 256); bytes that are not valid UTF-8 decode to U+FFFD."""

    name = BYTES

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face tokenizer.json (BPE, Unigram, WordPiece...) through the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise UserError("this run uses a tokenizer.json, which needs the `tokenizers` package: "
                            "pip install tokenizers") from None
        try:
            self.tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own exception type for unreadable files
            raise UserError(f"{path}: not a readable tokenizer.json ({exc})") from None
        self.name = str(path)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(spec: str, run_dir: Path | None = None) -> Tokenizer:
    """The tokenizer a run names: "bytes", or a tokenizer.json path (relative to `run_dir` unless absolute)."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_absolute() and run_dir is not None:
        path = run_dir / path
    if not path.is_file():
        raise UserError(f"the run's tokenizer {spec!r} is missing: no file {path}")
    return JsonTokenizer(path)
