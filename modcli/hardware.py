"""Device, dtype and seeding: the flags --device, --dtype and --seed, resolved once; the CPU's vendor and allocator."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
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
        return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    return device.type


@functools.cache
def cpu_vendor() -> str:
    """This machine's CPU vendor (`vendor_of` Linux's /proc/cpuinfo, or of `platform.processor()` without it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            cpuinfo = file.read()
    except OSError:
        cpuinfo = None
    return vendor_of(cpuinfo, platform.processor())


def vendor_of(cpuinfo: str | None, processor: str) -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...; "" where neither says): the vendor_id line of
    /proc/cpuinfo's text, else one named in `processor` (Windows names the vendor there)."""
    for line in (cpuinfo or "").splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return next((vendor for vendor in ("GenuineIntel", "AuthenticAMD") if vendor in processor), "")


ALLOCATOR_NOTE = ""
"""What `tune_cpu_allocator` set ("" until it runs or when it left the allocator alone)."""
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def tune_cpu_allocator() -> str:
    """Keep freed activation memory in glibc's heap instead of handing it back to the kernel at every free.

    By default glibc serves each block over its (adaptive) mmap threshold with a fresh mapping and unmaps it when
    freed, and trims the heap's top; an MoD forward frees and reallocates activations of many sizes (T tokens in a
    dense block, k in a routed one), so the threshold never settles and every step pays page faults to zero the
    same megabytes again. Measured on the small preset (2 cores): a dense block at batch 8, T 256 took 26 ms with
    the default and 18 ms with this, an MoD model's dense blocks at batch 1 4.0 ms against the dense model's
    2.7 ms. So: blocks under 32 MiB come from the heap and up to 1 GiB of free heap is kept. The process keeps its
    peak memory rather than returning it. Nothing is changed where MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_
    or MALLOC_TOP_PAD_ are set (the user's or `modcli profile`'s memory children's choice) or without glibc.
    Returns what was set ("" if nothing)."""
    global ALLOCATOR_NOTE

    if ALLOCATOR_NOTE or any(f"MALLOC_{name}_" in os.environ for name in ("MMAP_THRESHOLD", "TRIM_THRESHOLD",
                                                                            "TOP_PAD")):
        return ALLOCATOR_NOTE
    try:

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
        if libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD) and libc.mallopt(m_trim_threshold, TRIM_THRESHOLD):
            ALLOCATOR_NOTE = "glibc malloc: mmap threshold 32 MiB, trim threshold 1 GiB (modcli.hardware.tune_cpu_allocator)"
    except (OSError, AttributeError):  # not glibc (macOS, musl, Windows): leave the allocator alone
        pass
    return ALLOCATOR_NOTE

