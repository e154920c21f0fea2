"""Device, dtype and seeding: the flags --device, --dtype and --seed, resolved once."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from modcli.errors import UserError


class _Dtypes(dict):
    """--dtype name -> torch dtype; an unknown name is a UserError naming the flag, wherever it is looked up."""

    def __missing__(self, name):
        raise UserError(f"--dtype must be one of {', '.join(self)}, got {name!r}")


TORCH_DTYPES = _Dtypes(float32=torch.float32, bfloat16=torch.bfloat16, float16=torch.float16)


def resolve_device(name: str) -> torch.device:
    """auto -> cuda, then mps, then cpu; an explicit device that is absent is a UserError."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps: no MPS device is available")
    if name not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device must be auto, cpu, cuda or mps, got {name!r}")
    return torch.device(name)


def autocast(device: torch.device, dtype: str):
    """Mixed precision for float16/bfloat16 (weights stay float32); nothing for float32."""
    if dtype not in TORCH_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=TORCH_DTYPES[dtype])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        import os
        return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    return device.type
