"""`modcli tokenizer train`: a byte-level BPE tokenizer.json trained on a corpus, for runs trained from scratch."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer

from modcli.commands.common import Json, stdout, user_errors

app = typer.Typer(help="Tokenizers for runs trained from scratch.", no_args_is_help=True)


@app.command("train")
@user_errors
def train_tokenizer(
    vocab_size: Annotated[int, typer.Option(help="Tokens in the vocabulary (the 256 bytes included).")] = 4096,
    data: Annotated[Optional[str], typer.Option(help="Text file or folder; default: the Python stdlib.")] = None,
    glob: Annotated[str, typer.Option(help="File pattern when --data is a folder.")] = "**/*",
    max_bytes: Annotated[int, typer.Option(help="Train on at most this many bytes of the training split.")] = 50_000_000,
    out: Annotated[str, typer.Option(help="Where to write the tokenizer.json.")] = "tokenizer.json",
    json_output: Json = False,
) -> None:
    """Train a byte-level BPE tokenizer on the corpus' training split; use it with `modcli train --tokenizer`."""
    from modcli.data.tokenizer import TokenizerTrainConfig
    from modcli.data.tokenizer import train_tokenizer as run

    result = run(TokenizerTrainConfig(vocab_size=vocab_size, data=data, glob=glob, max_bytes=max_bytes, out=out))
    if json_output:
        from modcli.reports.console import print_json
        print_json(dataclasses.asdict(result))
        return
    stdout.print(f"wrote {result.out}: {result.vocab_size:,} tokens, trained on {result.bytes:,} bytes of "
                 f"{result.corpus}; {result.bytes_per_token:.2f} bytes per token on the validation split",
                 highlight=False)
