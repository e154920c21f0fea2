"""The run's tokenizer: bytes (the default: token = byte, vocabulary 256) or a Hugging Face `tokenizer.json` read with
the `tokenizers` library (imported runs, `modcli import`). A run names its tokenizer in `DataConfig.tokenizer`:
"bytes", or the path of a tokenizer.json relative to the run folder (or absolute).

The tokenizers are the PyTorch-free runtime's (modcli_runtime.text), so a run and its exported bundle read text
through the same code; `modcli tokenizer train` is modcli.data.tokenizer_training.
"""

from __future__ import annotations

from pathlib import Path

from modcli_runtime.errors import TokenizerError
from modcli_runtime.text import BYTES, ByteTokenizer, JsonTokenizer, Tokenizer, token_id_bound

from modcli.errors import UserError

__all__ = ["BYTES", "ByteTokenizer", "JsonTokenizer", "Tokenizer", "check_fits", "check_tokenizer_json",
           "load_tokenizer"]


def load_tokenizer(spec: str, run_dir: Path | None = None, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer a run names: "bytes", or a tokenizer.json path (relative to `run_dir` unless absolute).
    `vocab_size`: the model's vocabulary, which must hold every id the tokenizer can give (else a UserError)."""
    if spec == BYTES:
        tokenizer: Tokenizer = ByteTokenizer()
    else:
        path = Path(spec)
        if not path.is_absolute() and run_dir is not None:
            path = run_dir / path
        if not path.is_file():
            raise UserError(f"the run's tokenizer {spec!r} is missing: no file {path}")
        try:
            tokenizer = JsonTokenizer(path)
        except TokenizerError as exc:
            raise UserError(str(exc)) from None
    if vocab_size is not None:
        check_fits(tokenizer.vocab_size, vocab_size, str(tokenizer.name if spec != BYTES else "the byte tokenizer"))
    return tokenizer


def check_fits(tokenizer_size: int, vocab_size: int, tokenizer_name: str) -> None:
    """A UserError naming both sizes when a tokenizer gives ids the model has no embedding for (a model imported or
    trained with another tokenizer): each such id would end in an IndexError inside the embedding."""
    if tokenizer_size > vocab_size:
        raise UserError(f"{tokenizer_name} has {tokenizer_size:,} tokens but the model's vocabulary has {vocab_size:,}: "
                        f"ids {vocab_size}..{tokenizer_size - 1} have no embedding (the tokenizer is not the model's)")


def check_tokenizer_json(text: str, vocab_size: int, where: str) -> None:
    """`modcli import`: the source's tokenizer.json text is readable and fits the model's vocabulary."""
    try:
        from tokenizers import Tokenizer as HFTokenizer

        tokenizer = HFTokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises its own exception type for a malformed file
        raise UserError(f"{where}: not a readable tokenizer.json ({' '.join(str(exc).split())})") from None
    check_fits(token_id_bound(tokenizer), vocab_size, f"{where}: the tokenizer")
