"""Tokens <-> text: the tokenizers (bytes, or a Hugging Face tokenizer.json) and the streamed UTF-8 output.

The one definition of each, for the runtime and for modcli's training side (modcli.data.tokenizer, modcli generate).
No torch: the `tokenizers` package is imported only when a tokenizer.json is read.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from modcli_runtime.errors import TokenizerError

BYTES = "bytes"
"""The name of the byte tokenizer (token = byte, vocabulary 256), the default of modcli runs."""


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token = byte of the UTF-8 text (vocabulary 256); bytes that are not valid UTF-8 decode to U+FFFD."""

    name = BYTES
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face tokenizer.json (BPE, Unigram, WordPiece...) through the `tokenizers` library."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise TokenizerError(f"{path}: reading a tokenizer.json needs the `tokenizers` package: "
                                 "pip install tokenizers") from None
        try:
            self.tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own exception type for unreadable files
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({exc})") from None
        self.name = str(path)

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id it can give (added tokens included): the model's vocabulary must
        reach it."""
        return token_id_bound(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def token_id_bound(tokenizer) -> int:
    """A `tokenizers.Tokenizer`'s largest token id + 1, added tokens included (its ids need not be contiguous)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


class TextPieces:
    """One row's output as it grows, as UTF-8 bytes: a byte token is its byte; with any other tokenizer, the text
    the whole row decodes to now, less what was already given (a token can complete a character begun before).

    A byte-level tokenizer.json decodes a character whose bytes are split over tokens to U+FFFD until its last byte
    arrives: a trailing U+FFFD is held back until later tokens complete the character or text follows it, as the
    byte stream's incremental UTF-8 decoder holds back an unfinished character.
    """

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.ids: list[int] = []
        self.text = ""

    def __call__(self, token: int) -> bytes:
        if isinstance(self.tokenizer, ByteTokenizer):
            return bytes([token]) if token < 256 else b""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        if not text.startswith(self.text):  # a decoder that rewrites earlier text: wait until it settles
            return b""
        piece, self.text = text[len(self.text):], text
        return piece.encode("utf-8")


class Utf8Stream:
    """Writes bytes of one sequence as text as soon as they form whole UTF-8 characters, after `prefix`.

    Called as `stream(row, data)` with each row's new bytes (`TextPieces` turns tokens into them).
    """

    def __init__(self, write: Callable[[str], None], prefix: str = "") -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.write = write
        self.prefix = prefix  # the prompt, written with the first token so that notes on stderr come before it

    def __call__(self, row: int, data: bytes) -> None:
        text = self.prefix + self.decoder.decode(data)
        self.prefix = ""
        if text:
            self.write(text)
