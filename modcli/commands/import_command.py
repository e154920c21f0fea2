"""`modcli import`: flags -> ImportConfig -> modcli.pretrained.importer.import_model -> summary."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer

from modcli.commands.common import Json, stdout, user_errors


@user_errors
def import_command(
    source: Annotated[str, typer.Argument(help="Hugging Face model folder (Llama, Mistral or Qwen2; safetensors).")],
    out: Annotated[str, typer.Option(help="Run folder to write.")],
    seq_len: Annotated[Optional[int], typer.Option(
        help="Context length of the run (default min(max_position_embeddings, 1024)).")] = None,
    dtype: Annotated[str, typer.Option(help="Dtype of the saved weights: float32, bfloat16 or float16.")] = "float32",
    json_output: Json = False,
) -> None:
    """Import a pretrained Hugging Face decoder as a dense modcli run (weights, config, tokenizer)."""
    from modcli.pretrained.importer import ImportConfig, import_model

    result = import_model(ImportConfig(source=source, out=out, seq_len=seq_len, dtype=dtype))
    if json_output:
        from modcli.reports.console import print_json
        print_json(dataclasses.asdict(result))
        return
    from modcli.reports.console import key_value_table
    stdout.print(key_value_table(f"imported {result.architecture}", [
        ("parameters", f"{result.parameters:,}"), ("vocabulary", f"{result.vocab_size:,}"),
        ("context (seq_len)", str(result.seq_len)), ("tokenizer", result.tokenizer),
        ("checkpoint", result.checkpoint)]))
