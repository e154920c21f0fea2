"""`modcli tokenizer train`: flags -> TokenizerTrainConfig -> modcli.train_tokenizer: a byte-level BPE
tokenizer.json trained on a corpus, for runs trained from scratch."""

from __future__ import annotations

import dataclasses
from typing import Any

import typer

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.commands.config_flags import config_flags, source_flags
from modcli.reports.console import print_json

app = typer.Typer(help="Tokenizers for runs trained from scratch.", no_args_is_help=True)


@app.command("train")
@subcommand
@config_flags(lambda: source_flags("data/tokenizer_training.py", "TokenizerTrainConfig"))
def train_tokenizer(
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Train a byte-level BPE tokenizer on the corpus' training split; use it with `modcli train --tokenizer`."""
    result = modcli.train_tokenizer(modcli.TokenizerTrainConfig(**flags))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    stdout.print(f"wrote {result.out}: {result.vocab_size:,} tokens, trained on {result.bytes:,} bytes of "
                 f"{result.corpus}; {result.bytes_per_token:.2f} bytes per token on the validation split",
                 highlight=False)
