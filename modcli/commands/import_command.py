"""`modcli import`: flags -> ImportConfig -> modcli.import_model -> summary."""

from __future__ import annotations

import dataclasses
from typing import Any

import modcli
from modcli.commands import options
from modcli.commands.common import stderr, stdout, subcommand
from modcli.commands.config_flags import config_flags, source_flags
from modcli.reports.console import key_value_table, print_json


@subcommand
@config_flags(lambda: source_flags("pretrained/importer.py", "ImportConfig", leave_out=("source", "out")))
def import_command(
    source: options.Source,
    out: options.ImportOut,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Import a pretrained Hugging Face decoder (Llama, Mistral, Qwen2, Qwen3 or Gemma 3; safetensors) as a dense
    modcli run (weights, config, tokenizer)."""
    result = modcli.import_model(modcli.ImportConfig(source, out, **flags),
                                 log=lambda message: stderr.print(message, highlight=False, soft_wrap=True))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    stdout.print(key_value_table(f"imported {result.architecture}", [
        ("parameters", f"{result.parameters:,}"), ("vocabulary", f"{result.vocab_size:,}"),
        ("context (seq_len)", str(result.seq_len)), ("tokenizer", result.tokenizer),
        ("checkpoint", result.checkpoint)]))
