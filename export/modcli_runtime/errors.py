"""The runtime's errors: what `modcli-run` reports as one line on stderr with exit code 2, without a traceback."""

from __future__ import annotations


class BundleError(Exception):
    """The bundle is missing, damaged, invalid or cannot run with the asked provider (exit code 2)."""

    exit_code = 2


class TokenizerError(Exception):
    """A tokenizer.json that cannot be read (or no `tokenizers` package to read it); the bundle and the training
    side each report it as their own error, naming the file."""

    exit_code = 2
