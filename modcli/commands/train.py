"""`modcli train`: flags -> RunConfig (modcli.resolve_run_config) -> modcli.train -> summary table."""

from __future__ import annotations

import dataclasses
import shlex
import textwrap
from pathlib import Path
from typing import Any

import modcli
from modcli.commands import options
from modcli.commands.common import is_main_process, stderr, stdout, subcommand
from modcli.commands.config_flags import config_flags, run_flags
from modcli.config import SHAPE_FIELDS, TrainConfig
from modcli.errors import UserError
from modcli.reports.console import human, key_value_table, print_json


@subcommand
@config_flags(run_flags)
def train(
    preset: options.Preset = None,
    config: options.ConfigFile = None,
    dense: options.Dense = None,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Train an MoD decoder (or its dense twin) on text; prints a summary table. Values come from --preset (default
    tiny), then --config, then the flags given (one per field of the model, data and training configs, the model
    family's and router's own options included)."""
    flags = {**(flags or {}), **({"dense": dense} if dense is not None else {})}
    base = preset or "tiny"
    out, resume, init_from = flags.get("out"), flags.get("resume"), flags.get("init_from")
    if resume and preset is None and config is None:
        # Resume with the run's own configuration; flags given now still apply (and are checked).
        run_dir = Path(out or TrainConfig.out)
        found = modcli.complete_checkpoints(run_dir)
        if not found:
            raise UserError(f"--resume: no complete checkpoint in {run_dir}")
        saved = modcli.read_config(found[-1]).to_dict()
        flags = {**saved["model"], **saved["data"], **saved["train"], **flags}
        base = None
    elif init_from:
        # Convert another run: its shape and tokenizer, this run's routing and training flags.
        saved = modcli.read_config(modcli.resolve_checkpoint(init_from))
        shape = {name: getattr(saved.model, name) for name in SHAPE_FIELDS}
        flags = {**shape, "seq_len": saved.model.seq_len, "tokenizer": saved.data.tokenizer, **flags}
    run_config = modcli.resolve_run_config(preset, str(config) if config else None, flags, default_preset=base)
    if init_from and not resume and run_config.model.routed_layers():
        # A conversion starts as the model it came from: a processed token gets the block's whole update (router
        # weight of value 1, the sigmoid's gradient), so with every token processed the logits are the original's;
        # and its causal rules keep --capacity of the tokens from the first step (calibrated on the first batch).
        defaults = {name: value for name, value in (("router_weight", "unit"), ("calibrate", True))
                    if name not in flags}
        if defaults:
            run_config = modcli.resolve_run_config(preset, str(config) if config else None, {**flags, **defaults},
                                                   default_preset=base)
    result = modcli.train(run_config, quiet=False)
    if not is_main_process():
        return
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    if result.dense:
        validation = [("validation loss", f"{result.val_loss:.4f}"),
                      ("validation bits/byte", f"{result.val_bits_per_byte:.4f}")]
    else:  # the causal losses first: a full-sequence mode (top-k) sees later tokens, so its loss is a reference only
        validation = [(f"validation loss (causal, {result.val_routing})", f"{result.val_loss:.4f}"),
                      (f"validation bits/byte (causal, {result.val_routing})", f"{result.val_bits_per_byte:.4f}")]
        for mode, loss in result.val_losses.items():
            if mode == result.val_routing:
                continue
            label = "causal" if result.val_causal[mode] else "non-causal reference"
            validation.append((f"validation loss ({mode}, {label})", f"{loss:.4f}"))
    if result.init_val_loss is not None:
        validation.append(("validation loss of the --init-from model", f"{result.init_val_loss:.4f}"))
    if result.expert_dropped_mean is not None:
        validation.append(("expert choices dropped (mean / max step)",
                           f"{result.expert_dropped_mean:.2%} / {result.expert_dropped_max:.2%}"))
    title = f"training summary ({run_config.model.kind})"
    stdout.print(key_value_table(title, [
        ("steps", str(result.steps)),
        ("parameters", f"{result.parameters:,}"),
        ("train loss", f"{result.train_loss:.4f}" if result.steps else "none (--max-steps 0: not trained)"),
        *validation,
        ("tokens", f"{result.tokens:,}"),
        ("training FLOPs", human(result.flops)),
        ("wall time", f"{result.wall_time_s:.1f} s"),
        ("tokens/s", f"{result.tokens_per_s:,.0f}"),
        ("checkpoint", result.checkpoint),
    ]))
    stderr.print(next_commands(run_config.train.out, run_config.model.seq_len, routed=not result.dense),
                 highlight=False, soft_wrap=True, markup=False)


def next_commands(run: str, seq_len: int, routed: bool) -> str:
    """What to run on the run just trained (stderr, after the summary), with its path as given to --out. Without a
    CHECKPOINT, eval, generate, export and routes read runs/latest, where train writes without --out."""
    run = shlex.quote(run)
    new_tokens = max(16, min(200, seq_len - 28))  # prompt + new tokens within the context the model was trained on
    lines = [f"modcli eval {run}", f'modcli generate {run} --prompt "def " --max-new-tokens {new_tokens} --temperature 0.6',
             f"modcli plot {run} --out curves.png"]
    if routed:
        # any text at hand: a README where there is one, else a file of the standard library
        text = "README.md" if Path("README.md").is_file() else shlex.quote(textwrap.__file__)
        lines.append(f"modcli routes {run} --text {text} --out routes.png")
    lines.append(f"modcli export {run}")
    return "next:\n" + "\n".join(f"  {line}" for line in lines)
