"""Checkpoints: `step-NNNNNNNN/` folders written to a temporary folder, fsynced, then renamed into place
(modcli.checkpoint.atomic, which export bundles use too).

A folder holds model.safetensors, optimizer.pt, config.json (the whole resolved run config), state.json
(step, tokens, FLOPs, every rank's RNG states, the float16 loss scaler and the sampler state) and a COMPLETE
marker written last; a folder without the marker is ignored, so an interrupted save never hides the previous
checkpoint. The marker records the sha256 and size of every file, and loading checks the binary files against it,
so a truncated or bit-flipped model.safetensors or optimizer.pt is refused instead of loaded. Anything wrong with a
checkpoint (damaged, edited into an impossible config, another model's weights) is a UserError naming the file.

A save that fails to write (disk full, no permission) removes its temporary folder, leaves every earlier checkpoint
as it was, and raises WriteFailed naming the path. Temporary folders left by a killed writer are cleaned up by the
next writer (`clean_stale`), which holds the run's lock (modcli.checkpoint.lock).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from modcli_runtime.bundle import sha256_of  # the one definition, shared with the PyTorch-free runtime
from safetensors.torch import load_file, save_file, save_model

from modcli.checkpoint import atomic
from modcli.config import ModelConfig, RunConfig, check_config_values
from modcli.errors import UserError, WriteFailed
from modcli.models.build import build_model, minimum_parameters
from modcli.models.decoder import MoDDecoder

STEP_DIR = re.compile(r"^step-(\d{8})$")
MARKER = "COMPLETE"
STALE = {"tmp": "an interrupted save", "old": "a replaced checkpoint", "trash": "an interrupted clean-up"}
"""Folders a save works in (modcli.checkpoint.atomic), and what leaves one behind: `.tmp-` (being written), `.old-`
(a checkpoint being replaced by a new save of the same step), `.trash-` (a pruned checkpoint being deleted)."""
VERIFIED_FILES = ("model.safetensors", "optimizer.pt")
"""Files checked against the sha256 in the marker when they are read. config.json and state.json are checked by
their contents instead, so that a config.json edited by hand is judged by what it says."""
SLOW_SAVE_ENV = "MODCLI_TEST_SLOW_SAVE"
"""Test hook, read from the environment only: seconds to pause before each step of a checkpoint save (and of the
publishing of an import's run folder or an export's folder), so that a test can kill the writer at every moment of a
save (tests/checkpoint/test_reliability.py)."""


def slow_save_pause() -> None:
    """The SLOW_SAVE_ENV pause, for the other writers' `atomic.publish_folder(pause=...)`."""
    _pause()


def _pause() -> None:
    try:
        delay = float(os.environ.get(SLOW_SAVE_ENV, "0") or 0)
    except ValueError:
        delay = 0.0
    if delay > 0:
        time.sleep(delay)


def save_checkpoint(run_dir: Path, step: int, model: MoDDecoder, optimizer_state: dict[str, Any] | None,
                    config: RunConfig, state: dict[str, Any], keep: int,
                    tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write step-NNNNNNNN/ atomically, then delete all but the newest `keep` complete checkpoints.

    `optimizer_state` is keyed by parameter name (torch.distributed.checkpoint's full state dict), so it loads
    into any world size and parallel mode. A failure to write raises WriteFailed and leaves the earlier checkpoints
    (and, for a step saved again, the earlier save of this step) as they were. `tensors`: more safetensors files
    by name (a LoRA run's adapters.safetensors), checked against the marker like the weights when read
    (`read_tensors`).
    """
    final = run_dir / f"step-{step:08d}"
    try:
        with atomic.publish_folder(final, marker=MARKER, pause=_pause) as tmp:  # the same step saved again: replaced
            _pause()
            save_model(model, str(tmp / "model.safetensors"))
            if optimizer_state is not None:
                _pause()
                torch.save(optimizer_state, tmp / "optimizer.pt")
            for name, file_tensors in (tensors or {}).items():
                _pause()
                save_file(file_tensors, str(tmp / name))
            _pause()
            (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
            _pause()
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
    except BaseException as exc:
        if is_write_error(exc):
            kept = complete_checkpoints(run_dir)
            intact = f"; the newest complete checkpoint, {kept[-1]}, is intact" if kept else ""
            raise WriteFailed(f"cannot write checkpoint {final}: {write_reason(exc, run_dir)}{intact}") from None
        raise
    _pause()
    for stale in complete_checkpoints(run_dir)[:-keep]:
        try:
            atomic.remove_folder(stale, pause=_pause)  # a kill while deleting leaves no half-deleted "complete" folder
        except OSError:
            pass  # pruning is tidying; the new checkpoint is saved
    return final


def is_write_error(exc: BaseException) -> bool:
    """A failure of the file system (disk full, permissions, I/O), as each writer reports it: OSError from Python,
    SafetensorError "I/O error" from safetensors, RuntimeError from torch.save's zip writer."""
    if isinstance(exc, OSError):
        return True
    text = str(exc)
    if type(exc).__name__ == "SafetensorError":
        return "I/O error" in text or "os error" in text
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("PytorchStreamWriter", "inline_container", "file write failed"))


def write_reason(exc: BaseException, run_dir: Path) -> str:
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
        if exc.filename:
            reason += f" ({exc.filename})"
    else:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return reason
    if free < 1 << 20 and "space" not in reason:
        reason += f" (the disk holding {run_dir} has {free:,} bytes free)"
    return reason


def clean_stale(run_dir: Path) -> list[str]:
    """Tidy what an interrupted save left in a run folder; returns one note per folder handled.

    Call only while holding the run's lock (no save can be in progress). A displaced checkpoint (`.old-`) whose
    step has no folder is put back; every other temporary folder is deleted. Nothing named step-* is touched.
    """
    return atomic.clean_stale(run_dir, r"step-\d{8}", MARKER, STALE, restored="a save that was interrupted")


RUN_FILES = re.compile(r"^(step-\d{8}|metrics\.jsonl|tensorboard)$")
"""What marks a folder as a run's: a checkpoint (complete or not), its metrics or its TensorBoard folder."""


def refuse_foreign_folder(run_dir: Path, command: str) -> None:
    """A non-empty --out that is not a run folder (nothing in it a run writes) is not `command`'s to write into: a
    UserError naming what it holds. Call after `clean_stale` (a killed save's leftovers are not the user's)."""
    try:
        names = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    except OSError as exc:
        raise UserError(f"--out {run_dir}: cannot read it: {exc.strerror or exc}") from None
    if names and not any(RUN_FILES.match(name) for name in names):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UserError(f"--out {run_dir} is a non-empty folder that modcli {command} did not write (it holds "
                        f"{shown}); pick another --out or an empty folder")


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (-> its newest complete checkpoint); anything else is a UserError."""
    p = Path(path)
    try:
        if not p.exists():
            raise UserError(f"no such checkpoint or run folder: {p}")
        if not p.is_dir():
            raise UserError(f"{p} is a file, not a modcli checkpoint or run folder")
        if (p / MARKER).is_file():
            if not (p / "model.safetensors").is_file():
                raise UserError(f"{p / 'model.safetensors'} is missing")
            return p
        found = complete_checkpoints(p)
        if found:
            return found[-1]
        if STEP_DIR.match(p.name):
            raise UserError(f"{p} is an incomplete checkpoint (no {MARKER} marker): its save was interrupted")
        partial = sorted(q.name for q in p.iterdir() if STEP_DIR.match(q.name))
        if partial:
            raise UserError(f"{p} holds no complete checkpoint: {partial[-1]} has no {MARKER} marker (its save was "
                            "interrupted)")
    except OSError as exc:
        raise UserError(f"cannot read {p}: {exc.strerror or exc}") from None
    raise UserError(f"{p} is not a modcli checkpoint or run folder (no step-*/ with model.safetensors)")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is unreadable: {_one_line(exc)}") from None


def read_config(checkpoint: Path) -> RunConfig:
    """The run config a checkpoint was saved with; an impossible value is a UserError naming config.json."""
    path = checkpoint / "config.json"
    raw = _read_json(path)
    check_config_values(raw, str(path))
    try:
        return RunConfig.read_saved(raw)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise UserError(f"{path} holds an impossible config: {_one_line(exc)}") from None


def read_state(checkpoint: Path) -> dict[str, Any]:
    """state.json; it must be an object whose step is the checkpoint's."""
    path = checkpoint / "state.json"
    state = _read_json(path)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise UserError(f"{path} is damaged: no step in it")
    match = STEP_DIR.match(checkpoint.name)
    if match and int(match.group(1)) != state["step"]:
        raise UserError(f"{path} says step {state['step']} but belongs to {checkpoint.name}")
    return state


# ------------------------------------------------------------------------------------ what a config may hold


# ------------------------------------------------------------------------------------ model files


def _marker_files(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """The files and sha256 the marker recorded; {} for markers written before it recorded them ("ok")."""
    path = checkpoint / MARKER
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is unreadable: {_one_line(exc)}") from None
    if text.strip() == "ok":
        return {}
    try:
        marker = json.loads(text)
        files = marker["files"]
        assert isinstance(files, dict)
        return files
    except (ValueError, KeyError, TypeError, AssertionError):
        raise UserError(f"{path} is damaged (not the marker modcli writes)") from None


def verify_file(checkpoint: Path, name: str) -> Path:
    """checkpoint/name exists and has the size and sha256 its marker recorded (when it recorded them)."""
    path = checkpoint / name
    if not path.is_file():
        raise UserError(f"{path} is missing")
    expected = _marker_files(checkpoint).get(name)
    if expected is None:
        return path
    size = path.stat().st_size
    if size != expected.get("bytes"):
        raise UserError(f"{path} is damaged: {size:,} bytes where {expected.get('bytes'):,} were saved (truncated or "
                        "overwritten)")
    if sha256_of(path) != expected.get("sha256"):
        raise UserError(f"{path} is damaged: its sha256 differs from the one recorded in {MARKER} when it was saved")
    return path


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors file's header, after checking that the file is as long as it says."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or length <= 0 or 8 + length > size:
                raise ValueError
            header = json.loads(f.read(length))
        tensors = {name: info for name, info in header.items() if name != "__metadata__"}
        end = max((int(info["data_offsets"][1]) for info in tensors.values()), default=0)
        shapes = {name: [int(d) for d in info["shape"]] for name, info in tensors.items()}
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        raise UserError(f"{path} is damaged: not a readable safetensors file ({size:,} bytes)") from None
    if 8 + length + end != size:
        raise UserError(f"{path} is damaged: {size:,} bytes where its header describes {8 + length + end:,} (truncated?)")
    return shapes


LEGACY_NAMES = (
    # Before routers were pluggable (modcli.models.routing), a routed block held its router and predictor directly.
    (re.compile(r"^(blocks\.\d+)\.router\.(weight|bias)$"), r"\1.router.score.\2"),
    (re.compile(r"^(blocks\.\d+)\.predictor\."), r"\1.router.predictor."),
)


def load_weights(model: MoDDecoder, checkpoint: Path) -> None:
    """Load model.safetensors into `model`, after checking the file against its marker and its shapes against the
    model; tensors named as before the router interface are renamed. Every mismatch is a one-line UserError."""
    path = verify_file(checkpoint, "model.safetensors")
    safetensors_shapes(path)
    try:
        state = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise UserError(f"{path} cannot be read: {_one_line(exc)}") from None
    for pattern, replacement in LEGACY_NAMES:
        state = {pattern.sub(replacement, name): tensor for name, tensor in state.items()}
    expected = model.state_dict()
    for name, tensor in state.items():
        if name in expected and tuple(expected[name].shape) != tuple(tensor.shape):
            raise UserError(f"{path} does not fit {checkpoint / 'config.json'}: {name} is {list(tensor.shape)} in the "
                            f"file but {list(expected[name].shape)} for the config (another model's weights?)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if model.config.tie_embeddings:  # the tied head is stored once, as the embedding
        missing = [name for name in missing if name != "head.weight"]
    if missing or unexpected:
        def names(found: list[str]) -> str:
            return ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "") if found else "none"

        raise UserError(f"{path} does not fit {checkpoint / 'config.json'}: missing {names(missing)}; unexpected "
                        f"{names(unexpected)}")


def read_tensors(checkpoint: Path, name: str) -> dict[str, torch.Tensor]:
    """A safetensors file `save_checkpoint(tensors=...)` wrote (checked against the marker)."""
    path = verify_file(checkpoint, name)
    safetensors_shapes(path)
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise UserError(f"{path} cannot be read: {_one_line(exc)}") from None


def read_optimizer_state(checkpoint: Path) -> dict[str, Any]:
    """The optimizer's full state dict, keyed by parameter name (loaded with weights_only=True)."""
    path = checkpoint / "optimizer.pt"
    if not path.is_file():
        raise UserError(f"{checkpoint}: no optimizer.pt to resume from")
    verify_file(checkpoint, "optimizer.pt")
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # zip, pickle and tensor errors of a damaged file
        raise UserError(f"{path} cannot be read: {_one_line(exc)}") from None
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise UserError(f"{path} is not an optimizer state")
    return state


def check_weights_file(checkpoint: Path, config: ModelConfig) -> None:
    """model.safetensors is intact (size and sha256 of its marker, a whole header) and holds at least the parameters
    `config` implies; run before building the model, so an absurd config.json allocates nothing."""
    weights = verify_file(checkpoint, "model.safetensors")
    stored = sum(math.prod(shape) for shape in safetensors_shapes(weights).values())
    least = minimum_parameters(config)
    if least > stored:
        raise UserError(f"{checkpoint / 'config.json'} describes a model of at least {least:,} parameters but {weights} "
                        f"holds {stored:,}: they do not belong together")


def load_model(run_or_checkpoint: str | Path, device: str = "cpu") -> MoDDecoder:
    """Load a trained model in eval mode (`from modcli import load_model`); call it as `model(tokens,
    routing="router")` with tokens (B, T)."""
    return load_model_from(run_or_checkpoint, device)[0]


def load_model_from(path: str | Path, device: str | torch.device = "cpu") -> tuple[MoDDecoder, RunConfig, Path]:
    """Load a run or checkpoint folder: (model in eval mode, its run config, the checkpoint folder).

    Before anything is allocated, the weights file is checked against its marker and the config's size against the
    tensors it holds, so a damaged or mismatched checkpoint is a UserError naming the file.
    """
    checkpoint = resolve_checkpoint(path)
    config = read_config(checkpoint)
    check_weights_file(checkpoint, config.model)
    model = build_model(config.model)
    load_weights(model, checkpoint)
    return model.to(device).eval(), config, checkpoint
