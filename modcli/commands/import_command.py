"""`modcli import`: flags -> ImportConfig -> modcli.import_model -> summary."""

from __future__ import annotations

import dataclasses

import typer

import modcli
from modcli.commands import options
from modcli.commands.common import stderr, stdout, subcommand
from modcli.reports.console import key_value_table, print_json


@subcommand
def import_command(
    ctx: typer.Context,
    source: options.Source,
    out: options.ImportOut,
    seq_len: options.SeqLen = None,
    dtype: options.Dtype = None,
    json_output: options.Json = False,
) -> None:
    """Import a pretrained Hugging Face decoder (Llama, Mistral or Qwen2; safetensors) as a dense modcli run
    (weights, config, tokenizer)."""
    result = modcli.import_model(options.build(modcli.ImportConfig, options.given(ctx)),
                                 log=lambda message: stderr.print(message, highlight=False, soft_wrap=True))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    stdout.print(key_value_table(f"imported {result.architecture}", [
        ("parameters", f"{result.parameters:,}"), ("vocabulary", f"{result.vocab_size:,}"),
        ("context (seq_len)", str(result.seq_len)), ("tokenizer", result.tokenizer),
        ("checkpoint", result.checkpoint)]))
