"""The exported folder's README.md: a Hugging Face model card whose fields come from the run (where it came from,
its router, capacity and causal rule, its validation loss, the share of tokens its routed blocks processed in the
export's check) and from the export's own check against modcli. Nothing is filled in that was not measured."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modcli.checkpoint.store import read_state, resolve_checkpoint
from modcli.config import RunConfig
from modcli.errors import UserError
from modcli.models.decoder import MoDDecoder
from modcli.models.routing.registry import ROUTER_KINDS


@dataclass
class Provenance:
    """Where the run's weights came from."""

    imported_from: str | None
    """The Hugging Face folder or GGUF file `modcli import` read (this run's, or its --init-from run's)."""
    architecture: str | None
    """Its architecture (LlamaForCausalLM, ...)."""
    init_from: str | None
    """The run this one was converted from (--init-from)."""
    step: int
    tokens: int
    init_val_loss: float | None
    """With --init-from: the original model's validation loss before training, on the run's windows."""


def provenance(run_config: RunConfig, checkpoint: Path) -> Provenance:
    state = read_state(checkpoint)
    imported, architecture = state.get("imported_from"), state.get("architecture")
    init_from = run_config.train.init_from
    if imported is None and init_from:
        try:
            origin = read_state(resolve_checkpoint(init_from))
            imported, architecture = origin.get("imported_from"), origin.get("architecture")
        except UserError:  # the original run was moved away: the card says only that it was converted from it
            pass
    return Provenance(imported, architecture, init_from, int(state["step"]), int(state.get("tokens", 0)),
                      state.get("init_val_loss"))


def last_validation(run_dir: Path, routing: str) -> dict[str, Any] | None:
    """The run's last evaluation record in metrics.jsonl: {"step", "val_loss", "routing"}, or None."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "val_loss" in record:
            last = record
    if last is None:
        return None
    loss, mode = last.get(f"val_loss_{routing}"), routing
    if loss is None:
        loss, mode = last["val_loss"], "the run's first causal mode"
    return {"step": last.get("step"), "val_loss": loss, "routing": mode}


def model_card(name: str, model: MoDDecoder, routing: str, origin: Provenance, validation: dict[str, Any] | None,
               plain: bool, architecture: str, check: dict[str, Any]) -> str:
    """README.md's text."""
    config = model.config
    caps = model.capabilities
    if origin.imported_from:
        base = f"`{origin.imported_from}` ({origin.architecture}), imported with `modcli import`"
        if origin.init_from:
            base += f", converted in the run `{origin.init_from}` (--init-from)"
    elif origin.init_from:
        base = f"the modcli run `{origin.init_from}` (--init-from)"
    else:
        base = "none: trained from scratch with modcli"
    if config.dense:
        router = "none (every block processes every token)"
        if config.noop_layers():
            router = (f"integrated MoDE: {config.noop_experts} no-op experts in the MoE of blocks "
                      f"{config.noop_layers()}; a token choosing one skips the MLP")
        capacity = causal = "-"
    else:
        router = f"`{config.router}`: {ROUTER_KINDS[config.router].summary}"
        capacity = (f"{config.capacity:g} (the share of tokens training selected); routed blocks "
                    f"{config.routed_layers()}, skipping the {_skipped(config)} of unselected tokens"
                    + (f"; positions 0..{config.keep_first - 1} always processed" if config.keep_first else ""))
        causal = f"`{routing}`: {caps.notes.get(routing, routing)}"
    quality = "not evaluated in the run (no metrics.jsonl record): `modcli eval RUN` measures it"
    if validation is not None:
        quality = (f"validation loss {validation['val_loss']:.4f} nats/token under {validation['routing']} routing "
                   f"(step {validation['step']}, the run's metrics.jsonl)")
    if origin.init_val_loss is not None:
        quality += f"; the original model's on the same windows before conversion: {origin.init_val_loss:.4f}"
    processed = check.get("processed_fraction") or {}
    compute = ("every token, every block" if not processed else
               ", ".join(f"{block} {share:.1%}" for block, share in processed.items())
               + f" of the tokens (measured on the export's check text, {check.get('check_tokens')} tokens)")
    checked = check.get("status", "not checked")
    trust = "" if plain else ", trust_remote_code=True"
    rows = [
        ("base model", base),
        ("architecture", f"{architecture}: {config.kind}, {config.n_layers} blocks, d_model {config.d_model}, "
                         f"{config.n_heads} heads ({config.kv_heads} key/value), vocabulary {config.vocab_size}, "
                         f"context {config.seq_len}"),
        ("router", router),
        ("capacity", capacity),
        ("causal rule", causal),
        ("training", f"{origin.step} steps, {origin.tokens:,} tokens in modcli"),
        ("quality", quality),
        ("compute", f"routed blocks processed {compute}"),
        ("speed", "not measured by the export: `modcli profile RUN --compare dense` times this model against its "
                  "dense twin (forward, training step, prefill and decode)"),
        ("check", checked),
    ]
    table = "\n".join(f"| {field} | {value} |" for field, value in rows)
    tags = ["modcli", "text-generation"] + ([] if config.dense else ["mixture-of-depths"])
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             "tags:", *(f"- {tag}" for tag in tags),
             "# base_model: the Hub id of the original model, before publishing (see the table)", "---"]
    return "\n".join([
        *front, "", f"# {name}", "",
        f"Exported by `modcli export --hf` from a modcli run ({config.kind}).", "",
        "| field | value |", "| --- | --- |", table, "",
        "## Loading", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        f"model = AutoModelForCausalLM.from_pretrained(path{trust})",
        f"tokenizer = AutoTokenizer.from_pretrained(path{trust})", "```", "",
        "Greedy by default (generation_config.json); `generate(..., do_sample=True, temperature=0.8)` samples.",
        *([] if config.dense else [
            "", "Every routed block decides token by token with the causal rule above (never a top-k over the "
                "sequence), in the forward pass and in `generate()` alike; a token it skips costs no attention or "
                "MLP work, and its KV cache holds only the tokens it processed."]),
        ""])


def _skipped(config) -> str:
    """What the routed blocks skip: one part, or per block (--route-part attention:1-9,mlp:20-25)."""
    return f"parts per block ({config.route_part})" if ":" in config.route_part else config.route_part
