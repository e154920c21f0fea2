"""The run's tokenizer: bytes (the default: token = byte, vocabulary 256) or a Hugging Face `tokenizer.json` read with
the `tokenizers` library (imported runs, `modcli import`). A run names its tokenizer in `DataConfig.tokenizer`:
"bytes", or the path of a tokenizer.json relative to the run folder (or absolute).

The tokenizers are the PyTorch-free runtime's (modcli_runtime.text), so a run and its exported bundle read text
through the same code; `modcli tokenizer train` is modcli.data.tokenizer_training.
"""

from __future__ import annotations

from pathlib import Path

from modcli_runtime.errors import TokenizerError
from modcli_runtime.text import BYTES, ByteTokenizer, JsonTokenizer, Tokenizer

from modcli.errors import UserError

__all__ = ["BYTES", "ByteTokenizer", "JsonTokenizer", "Tokenizer", "load_tokenizer"]


def load_tokenizer(spec: str, run_dir: Path | None = None) -> Tokenizer:
    """The tokenizer a run names: "bytes", or a tokenizer.json path (relative to `run_dir` unless absolute)."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_absolute() and run_dir is not None:
        path = run_dir / path
    if not path.is_file():
        raise UserError(f"the run's tokenizer {spec!r} is missing: no file {path}")
    try:
        return JsonTokenizer(path)
    except TokenizerError as exc:
        raise UserError(str(exc)) from None
