"""`modcli export RUN --hf --out OUT`: write the Hugging Face folder, check it against modcli, publish it.

The folder: config.json (for a routed or MoE model with `auto_map` to the folder's configuration_modcli.py and
modeling_modcli.py), model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json (greedy) and
README.md (the model card). It is written into a temporary folder and renamed into place at the end, under --out's
lock (the one every writing command takes), like an ONNX bundle, and never over a folder that appeared or changed at
--out after it was checked; config.json's `modcli_export` record marks it as modcli's, so --force replaces only such a
folder. A write the disk refuses (full, a file-size limit) is one line, exit code 1, and leaves nothing behind.

Where transformers is installed, the folder is loaded back with `AutoModelForCausalLM.from_pretrained` before it is
published and compared with modcli under the exported causal routing mode: logits on the check text and on a
left-padded batch of two prompts, and greedy `generate()` tokens (batch 1, and the left-padded batch of 2) against
modcli's cached decoding. A difference beyond --atol is an error and publishes nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

import modcli
from modcli.bundle.config import ExportConfig
from modcli.bundle.hf.card import last_validation, model_card, provenance
from modcli.bundle.hf.convert import REMOTE, REMOTE_FILES, Converted, convert
from modcli.bundle.hf.tokenizer import write_tokenizer
from modcli.bundle.validation import validation_text
from modcli.bundle.writer import Progress, check_out, timed_export, write_failed
from modcli.checkpoint import atomic
from modcli.checkpoint.store import load_model_from, slow_save_pause
from modcli.decode.generation import prefill
from modcli.decode.greedy import greedy_decode
from modcli.errors import ReportedError
from modcli.hardware import TORCH_DTYPES
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder

MARKER_KEY = "modcli_export"
"""config.json's record of the export; a folder whose config.json has it is one --force may replace."""
CHECK_TOKENS = 64
"""Tokens of the check text (at most the model's context)."""


class ValidationFailed(ReportedError):
    """The exported folder, loaded by transformers, differs from modcli beyond --atol: exit code 1."""


@dataclass
class HFCheck:
    case: str
    max_abs_diff: float | None
    """Largest |logit difference| (None for a token comparison)."""
    tokens_match: bool | None
    passed: bool


@dataclass
class HFExportResult:
    """What `export --hf` wrote and checked."""

    folder: str
    architecture: str
    remote_code: bool
    routing: str
    dtype: str
    atol: float
    files: dict[str, int]
    """File name -> bytes."""
    checks: list[HFCheck] = field(default_factory=list)
    checked: bool = False
    """The folder was loaded back with transformers and compared with modcli (false: transformers not installed)."""
    seconds: float = 0.0


def _written_by_export_hf(out: Path) -> bool:
    """Whether `out` is a folder `export --hf` wrote (its config.json carries the marker)."""
    try:
        return MARKER_KEY in json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False


def export_hf(config: ExportConfig, log: Callable[[str], None] | None = None) -> HFExportResult:
    """Convert, check and write the folder; every user mistake is a UserError and leaves nothing behind."""
    return timed_export(config, _export, log)


def _export(config: ExportConfig, out: Path, log: Progress) -> HFExportResult:
    check_out(out, config.force, _written_by_export_hf, "folder",
              f"that `modcli export --hf` did not write (no {MARKER_KEY} in its config.json)")
    checked = atomic.folder_state(out)  # what is published over must still be this
    model, run_config, checkpoint = load_model_from(config.checkpoint, "cpu")
    family = model.config.family
    routing = config.routing or (model.causal_modes() or ("dense",))[0]
    model.check_routing(routing, causal=True)
    if family.decoding_options and family.exportable:
        log(f"note: --arch {family.name}: the folder holds the full-depth model; its own decoding (modcli generate "
            f"{' / '.join(family.decoding_flags())}) is not in it")
    dtype = TORCH_DTYPES[config.dtype]
    origin = provenance(run_config, checkpoint)
    converted = convert(model, routing, origin.architecture, dtype)
    model = model.to(dtype).eval()
    tokenizer = run_config.data.tokenizer
    tokenizer_file = None if tokenizer == "bytes" else checkpoint.parent / tokenizer
    log(f"writing {converted.architecture}" + ("" if converted.plain else " (remote code)")
        + ("" if model.config.dense else f", {routing} routing"))
    result = HFExportResult(str(out), converted.architecture, not converted.plain, routing, config.dtype,
                            float(config.atol), {})
    try:
        with atomic.publish_folder(out, expect=checked, pause=slow_save_pause) as tmp:
            _write_folder(tmp, model, converted, routing, run_config, checkpoint, tokenizer_file)
            log(f"wrote model.safetensors ({(tmp / 'model.safetensors').stat().st_size / 1e6:.2f} MB) and the "
                "tokenizer")
            check_record: dict[str, Any] = {"status": "not checked: transformers is not installed"}
            if importlib.util.find_spec("transformers") is not None:
                text = validation_text(config.text, model.config.vocab_size)
                with log.step("checking the folder in transformers against modcli"):
                    result.checks, processed = check_folder(tmp, model, routing, text, config, converted.plain)
                result.checked = True
                worst = max((c.max_abs_diff for c in result.checks if c.max_abs_diff is not None), default=0.0)
                status = "passed" if all(c.passed for c in result.checks) else "FAILED"
                check_record = {"status": f"{status}: transformers {_transformers_version()} against modcli "
                                          f"{modcli.__version__}, max abs logit difference {worst:.2e} (atol "
                                          f"{config.atol:g}), greedy generate() tokens "
                                          + ("equal" if all(c.tokens_match is not False for c in result.checks)
                                             else "differ"),
                                "processed_fraction": processed, "check_tokens": min(CHECK_TOKENS,
                                                                                     model.config.seq_len)}
                failures = [c for c in result.checks if not c.passed]
                if failures:
                    raise ValidationFailed(
                        f"the exported folder differs from modcli (nothing written to {out}): " + "; ".join(
                            f"{c.case}: " + (f"max |diff| {c.max_abs_diff:.3g}" if c.max_abs_diff is not None
                                             else "tokens differ") for c in failures))
            else:
                log("note: transformers is not installed: the folder was not loaded back and checked")
            card = model_card(out.name, model, routing, origin, last_validation(checkpoint.parent, routing),
                              converted.plain, converted.architecture, check_record)
            (tmp / "README.md").write_text(card, encoding="utf-8")
            result.files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            log(f"publishing {out}")
    except Exception as exc:
        failed = write_failed(exc, f"the folder {out}")
        if failed is None:
            raise
        raise failed from None
    return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _write_folder(tmp: Path, model: MoDDecoder, converted: Converted, routing: str, run_config, checkpoint: Path,
                  tokenizer_file: Path | None) -> None:
    record = {"modcli_version": modcli.__version__, "checkpoint": str(checkpoint.resolve()), "routing": routing,
              "kind": model.config.kind, "run_config": run_config.to_dict()}
    (tmp / "config.json").write_text(json.dumps({**converted.config, MARKER_KEY: record}, indent=2))
    save_file(converted.state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if not converted.plain:
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, tmp / name)
    tokenizer_config = write_tokenizer(tmp, tokenizer_file, model.config.seq_len)
    pad = 0 if "pad_token" in tokenizer_config else None
    generation = {"do_sample": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": pad}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))


# ----------------------------------------------------------------------------------------------- the check


def _modcli_greedy(model: MoDDecoder, prompts: list[list[int]], steps: int, routing: str) -> list[list[int]]:
    """modcli generate's greedy tokens: the causal prefill of the right-padded prompts, then cached decode steps."""
    cache = DecoderCache.allocate(model.config, len(prompts), max(len(p) for p in prompts) + steps,
                                  torch.device("cpu"), next(model.parameters()).dtype)
    logits = prefill(model, prompts, cache, routing, torch.device("cpu"), "float32")
    out: list[torch.Tensor] = []
    greedy_decode(logits, steps, lambda tokens: model.decode_step(tokens, cache, routing).float(),
                  lambda index, tokens, logits: out.append(tokens))
    return torch.stack(out, dim=1).tolist()


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


@torch.no_grad()
def check_folder(folder: Path, model: MoDDecoder, routing: str, text: np.ndarray, config: ExportConfig,
                 plain: bool) -> tuple[list[HFCheck], dict[str, float]]:
    """Load `folder` with transformers and compare it with modcli; also the share of the check text's tokens each
    routed block processed (modcli's causal pass)."""
    from transformers import AutoModelForCausalLM

    atol = float(config.atol)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=not plain,
                                              dtype=TORCH_DTYPES[config.dtype]).eval()
    length = min(CHECK_TOKENS, model.config.seq_len)
    tokens = torch.from_numpy(np.resize(text, length)).long()[None]  # (1, T)
    expected, aux = model(tokens, routing, return_aux=True)
    checks = [_logits_check(f"text T={length}", hf(tokens).logits, expected, atol)]
    processed = {f"block{r.layer}": float(r.selection.counts.sum()) / tokens.numel() for r in aux.records}

    prompts = [tokens[0, :7].tolist(), tokens[0, 20:36].tolist()]
    ids, mask = _left_padded(prompts)
    padded = hf(ids, attention_mask=mask).logits  # (2, W, V)
    diff = 0.0
    for row, prompt in enumerate(prompts):
        mine = padded[row, ids.shape[1] - len(prompt):]
        diff = max(diff, (mine.float() - model(torch.tensor([prompt]), routing)[0].float()).abs().max().item())
    checks.append(HFCheck("left-padded B=2", diff, None, diff <= atol))

    steps = config.decode_steps
    reference = _modcli_greedy(model, prompts, steps, routing)
    single = hf.generate(torch.tensor([prompts[1]]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    checks.append(HFCheck(f"generate B=1, {steps} greedy tokens", None,
                          single[0, len(prompts[1]):].tolist() == reference[1], True))
    both = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    checks.append(HFCheck(f"generate left-padded B=2, {steps} greedy tokens", None,
                          both[:, ids.shape[1]:].tolist() == reference, True))
    checks = [dataclasses.replace(c, passed=c.passed and c.tokens_match is not False) for c in checks]
    return checks, processed


def _logits_check(case: str, got: torch.Tensor, expected: torch.Tensor, atol: float) -> HFCheck:
    diff = (got.float() - expected.float()).abs().max().item()
    return HFCheck(case, diff, None, diff <= atol)
