"""`modcli profile`: flags -> ProfileConfig -> modcli.profile -> one table per sequence length."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.commands.config_flags import ConfigFlag, config_flags, flags_of, model_flags
from modcli.errors import UserError
from modcli.profiling.config import ProfileConfig
from modcli.profiling.report import tables
from modcli.reports.console import print_json


def fresh_model_flags() -> list[ConfigFlag]:
    """The flags that shape a fresh model: the model's fields (and its variants' options) but seq_len, which is
    here the length measured."""
    return model_flags(leave_out=("seq_len",))


def measurement_flags() -> list[ConfigFlag]:
    """What is measured and how: ProfileConfig's fields but the model and checkpoint."""
    return flags_of(ProfileConfig, leave_out=("checkpoint", "model"))


@subcommand
@config_flags(measurement_flags, fresh_model_flags)
def profile(
    checkpoint: options.FreshOrCheckpoint = None,
    preset: options.Preset = None,
    config: options.ConfigFile = None,
    seq_len: options.SeqLen = None,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """FLOPs, latency, tokens/s, peak memory and KV-cache bytes of an MoD model against its dense twin (or a
    checkpoint). Without CHECKPOINT, a freshly initialised model of --preset (default small), --config and the model
    flags."""
    measuring = {f.name for f in dataclasses.fields(ProfileConfig)}
    values = {name: value for name, value in flags.items() if name in measuring}
    model_values = {name: value for name, value in flags.items() if name not in measuring}
    model = None
    if checkpoint is None or model_values or preset or config:
        model = modcli.resolve_run_config(preset, str(config) if config else None, model_values,
                                          default_preset="small").model
    if seq_len is not None and "seq_lens" in values:
        raise UserError("give --seq-len or --seq-lens, not both")
    if seq_len is not None:
        values["seq_lens"] = [seq_len]
    result = modcli.profile(ProfileConfig(checkpoint=checkpoint, model=model, **values))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    out = stdout if stdout.is_terminal else Console(width=120)  # a pipe or file gets whole rows, not 80 columns
    for table in tables(result):
        out.print(table)
    out.print(f"[dim]{result.flops_note}\n{result.memory_method}[/]", highlight=False)
