"""`modcli tokenizer train`: flags -> TokenizerTrainConfig -> modcli.train_tokenizer: a byte-level BPE
tokenizer.json trained on a corpus, for runs trained from scratch."""

from __future__ import annotations

import dataclasses

import typer

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.reports.console import print_json

app = typer.Typer(help="Tokenizers for runs trained from scratch.", no_args_is_help=True)


@app.command("train")
@subcommand
def train_tokenizer(
    ctx: typer.Context,
    vocab_size: options.VocabSize = None,
    data: options.Data = None,
    glob: options.Glob = None,
    max_bytes: options.MaxBytes = None,
    out: options.TokenizerOut = None,
    json_output: options.Json = False,
) -> None:
    """Train a byte-level BPE tokenizer on the corpus' training split; use it with `modcli train --tokenizer`."""
    result = modcli.train_tokenizer(options.build(modcli.TokenizerTrainConfig, options.given(ctx)))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    stdout.print(f"wrote {result.out}: {result.vocab_size:,} tokens, trained on {result.bytes:,} bytes of "
                 f"{result.corpus}; {result.bytes_per_token:.2f} bytes per token on the validation split",
                 highlight=False)
