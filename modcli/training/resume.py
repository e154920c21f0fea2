"""What a resumed run needs to repeat an uninterrupted one exactly: the checks that the config matches the
checkpoint's, every rank's RNG states and the float16 loss scaler's state (state.json)."""

from __future__ import annotations

import base64
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from modcli.config import RunConfig
from modcli.errors import UserError
from modcli.training import distributed
from modcli.training.distributed import DistributedContext


def check_resumable(saved: RunConfig, config: RunConfig, checkpoint: Path) -> None:
    for section in ("model", "data"):
        old, new = getattr(saved, section), getattr(config, section)
        for f in fields(old):
            if getattr(old, f.name) != getattr(new, f.name):
                raise UserError(
                    f"--resume: --{f.name.replace('_', '-')} is {getattr(new, f.name)!r} but {checkpoint} was "
                    f"trained with {getattr(old, f.name)!r}"
                )


def _encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_states(device: torch.device) -> dict[str, str]:
    """This process' CPU RNG state and, on CUDA, its device's RNG state (base64, for state.json)."""
    states = {"torch": _encode_rng(torch.get_rng_state())}
    if device.type == "cuda":
        states["cuda"] = _encode_rng(torch.cuda.get_rng_state(device))
    return states


def restore_rng_states(states: dict[str, str], device: torch.device) -> None:
    """Undo `rng_states`; a CUDA state saved by a CPU run (or the reverse) leaves that generator as seeded."""
    torch.set_rng_state(_decode_rng(states["torch"]))
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(_decode_rng(states["cuda"]), device)


def gather_resume_state(scaler: torch.amp.GradScaler, context: DistributedContext) -> dict[str, Any] | None:
    """The random state a resumed run needs to repeat this one exactly, for state.json (a collective).

    On rank 0: {"rng": {"ranks": [per-rank CPU and CUDA RNG states, indexed by rank]}, "grad_scaler": the float16
    loss scaler's state_dict ({} when --dtype is not float16; it is the same on every rank)}. None elsewhere.
    """
    states = distributed.gather_to_main(rng_states(context.device), context)
    if states is None:
        return None
    return {"rng": {"ranks": states}, "grad_scaler": scaler.state_dict()}


def restore_resume_state(state: dict[str, Any], scaler: torch.amp.GradScaler, context: DistributedContext,
                         dropout: float) -> str | None:
    """Load what `gather_resume_state` saved into this rank; returns a note for rank 0 to print, if any.

    With the world size of the saved run each rank takes its own RNG states. A checkpoint written before
    per-rank states holds only rank 0's CPU state (`rng.torch`); the other ranks then keep their fresh seeds. With
    another world size every rank keeps its fresh seed, so dropout masks differ from an uninterrupted run.
    """
    rng = state.get("rng", {})
    per_rank = rng.get("ranks", [{"torch": rng["torch"]}] if "torch" in rng else [])
    saved_world = state.get("world_size", 1)
    note = None
    if saved_world == context.world_size:
        if context.rank < len(per_rank):
            restore_rng_states(per_rank[context.rank], context.device)
    elif dropout > 0:
        note = (f"note: the checkpoint was saved with world size {saved_world} and resumes with world size "
                f"{context.world_size}: ranks start from fresh seeds, so dropout randomness differs from an "
                "uninterrupted run")
    if state.get("grad_scaler") and scaler.is_enabled():
        scaler.load_state_dict(state["grad_scaler"])
    return note
