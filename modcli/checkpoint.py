"""Checkpoints: `step-NNNNNNNN/` folders written to a temporary folder, fsynced, then renamed into place.

A folder holds model.safetensors, optimizer.pt, config.json (the whole resolved run config), state.json
(step, tokens, FLOPs, every rank's RNG states, the float16 loss scaler and the sampler state) and a COMPLETE
marker written last; a folder without the marker is ignored, so an interrupted save never hides the previous
checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model

from modcli.config import RunConfig
from modcli.errors import UserError
from modcli.model import MoDDecoder

STEP_DIR = re.compile(r"^step-(\d{8})$")
MARKER = "COMPLETE"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, model: MoDDecoder, optimizer_state: dict[str, Any] | None,
                    config: RunConfig, state: dict[str, Any], keep: int) -> Path:
    """Write step-NNNNNNNN/ atomically, then delete all but the newest `keep` complete checkpoints.

    `optimizer_state` is keyed by parameter name (torch.distributed.checkpoint's full state dict), so it loads
    into any world size and parallel mode.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"step-{step:08d}"
    tmp = run_dir / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    for child in tmp.iterdir():
        _fsync_file(child)
    (tmp / MARKER).write_text("ok\n")
    _fsync_file(tmp / MARKER)
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (a resumed run): swap, then remove the old one
        old = run_dir / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(run_dir)
    for stale in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (-> its newest complete checkpoint); anything else is a UserError."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"no such checkpoint or run folder: {p}")
    if (p / MARKER).is_file() and (p / "model.safetensors").is_file():
        return p
    if p.is_dir():
        found = complete_checkpoints(p)
        if found:
            return found[-1]
        if STEP_DIR.match(p.name):
            raise UserError(f"{p} is an incomplete checkpoint (no {MARKER} marker): its save was interrupted")
    raise UserError(f"{p} is not a modcli checkpoint or run folder (no step-*/ with model.safetensors)")


def read_config(checkpoint: Path) -> RunConfig:
    try:
        raw = json.loads((checkpoint / "config.json").read_text())
        return RunConfig.from_dict(raw)
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        raise UserError(f"{checkpoint}: unreadable config.json ({exc})") from None


def read_state(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{checkpoint}: unreadable state.json ({exc})") from None


LEGACY_NAMES = (
    # Before routers were pluggable (modcli.routing), a routed block held its router and predictor directly.
    (re.compile(r"^(blocks\.\d+)\.router\.(weight|bias)$"), r"\1.router.score.\2"),
    (re.compile(r"^(blocks\.\d+)\.predictor\."), r"\1.router.predictor."),
)


def load_weights(model: MoDDecoder, checkpoint: Path) -> None:
    """Load model.safetensors into `model`; tensors named as before the router interface are renamed."""
    from safetensors.torch import load_file

    try:
        state = load_file(str(checkpoint / "model.safetensors"))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise UserError(f"{checkpoint}: model.safetensors cannot be read ({exc})") from None
    for pattern, replacement in LEGACY_NAMES:
        state = {pattern.sub(replacement, name): tensor for name, tensor in state.items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise UserError(f"{checkpoint}: model.safetensors does not match its config.json ({exc})") from None
    if model.config.tie_embeddings:  # the tied head is stored once, as the embedding
        missing = [name for name in missing if name != "head.weight"]
    if missing or unexpected:
        raise UserError(f"{checkpoint}: weights do not match the config (missing {missing}, unexpected {unexpected})")


def read_optimizer_state(checkpoint: Path) -> dict[str, Any]:
    """The optimizer's full state dict, keyed by parameter name (loaded with weights_only=True)."""
    path = checkpoint / "optimizer.pt"
    if not path.is_file():
        raise UserError(f"{checkpoint}: no optimizer.pt to resume from")
    return torch.load(path, weights_only=True, map_location="cpu")


def load_model_from(path: str | Path, device: str | torch.device = "cpu") -> tuple[MoDDecoder, RunConfig, Path]:
    """Load a run or checkpoint folder: (model in eval mode, its run config, the checkpoint folder)."""
    checkpoint = resolve_checkpoint(path)
    config = read_config(checkpoint)
    model = MoDDecoder(config.model)
    load_weights(model, checkpoint)
    return model.to(device).eval(), config, checkpoint
