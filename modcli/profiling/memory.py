"""Peak memory of each `modcli profile` measurement, each in a fresh child process holding only that model.

The child runs the very calls that are timed (`modcli.profiling.calls`) twice, on the same tokens; what is counted
is `MEMORY_METHOD`, which the result carries.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import modcli_runtime
import torch
from safetensors.torch import load_model, save_model

import modcli
from modcli.config import ModelConfig
from modcli.models.build import build_model
from modcli.models.decoder import MoDDecoder
from modcli.packed_linear import inference_linears
from modcli.profiling.calls import decode_call, forward_call, input_tokens, train_call
from modcli.profiling.config import ModelProfile, ProfileConfig, Timing

MEMORY_METHOD = (
    "peak_mem_bytes: each measurement runs twice in a fresh child process holding only that model. CPU: the "
    "model's parameter and buffer bytes plus the rise of the process's peak resident set (VmHWM, reset through "
    "/proc/self/clear_refs once the model is built and freed heap memory is trimmed; glibc maps every block over "
    "128 KiB on its own, so freed tensors leave the resident set) while the calls run: weights, gradients, "
    "optimizer state, activations, KV cache, the packed weight copies of CPU inference (modcli.packed_linear), "
    "library buffers and some allocator slack are counted, the Python "
    "and library code is not. CUDA: the same with torch.cuda.max_memory_allocated after "
    "reset_peak_memory_stats (tensor memory only, not the allocator's reserve). Other devices: not measured."
)


def save_for_children(models: dict[str, MoDDecoder], folder: Path) -> dict[str, str]:
    """Each model's weights as a safetensors file in `folder`, for the children to load: name -> path."""
    paths = {}
    for name, m in models.items():
        path = folder / f"{name}.safetensors"
        save_model(m, str(path))
        paths[name] = str(path)
    return paths


def measure_memory(config: ProfileConfig, models: dict[str, MoDDecoder], weights: dict[str, str], seq_len: int,
                   device: torch.device, out: dict[str, ModelProfile]) -> None:
    """Fill in `peak_mem_bytes` of every timed measurement in `out` (the prefill shares the decode call's peak)."""
    kinds = {"forward": "forward", "train": "train_step", "decode": "decode"}
    jobs = []
    for name, m in models.items():
        for measurement in config.measure:
            spec = {"model": m.config.flat(), "weights": weights[name], "measurement": measurement,
                    "batch_size": config.batch_size, "seq_len": seq_len, "seed": config.seed,
                    "decode_tokens": config.decode_tokens, "routing": config.routing, "device": str(device),
                    "dtype": config.dtype, "threads": torch.get_num_threads(),
                    "packed_linears": config.packed_linears}
            jobs.append((name, kinds[measurement], spec))
    # Memory does not depend on timing, so two children run at once to save wall time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        peaks = list(pool.map(lambda job: _run_memory_child(job[2]), jobs))
    for (name, attribute, _), peak in zip(jobs, peaks, strict=True):
        timing: Timing = getattr(out[name], attribute)
        timing.peak_mem_bytes = peak
        if attribute == "decode":
            out[name].prefill.peak_mem_bytes = peak  # one call holds both: the prefill and the steps after it


def _run_memory_child(spec: dict[str, Any]) -> int | None:
    # The child imports the very modcli and modcli_runtime this process runs, wherever they were imported from.
    roots = [str(Path(package.__file__).resolve().parent.parent) for package in (modcli, modcli_runtime)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [*roots, os.environ.get("PYTHONPATH")])))
    # glibc: every block over 128 KiB gets its own mapping, returned to the system when freed, so the resident set
    # follows the live tensors instead of what the heap kept from earlier calls (the child is never timed).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    done = subprocess.run([sys.executable, "-c", "from modcli.profiling.memory import memory_child; memory_child()"],
                          input=json.dumps(spec), capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the memory measurement process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mem_bytes"]


def memory_child() -> None:
    """Entry point of the child process: read a spec on stdin, print {"peak_mem_bytes": n or null} on stdout."""
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    model_config = ModelConfig.of(**spec["model"])
    model = build_model(model_config)
    load_model(model, spec["weights"])
    model = model.to(device).eval()
    tokens = input_tokens(model_config, spec["batch_size"], spec["seq_len"], spec["seed"], device)
    # the packed copies of the weights (modcli.packed_linear) are made in the first call: its peak holds them
    linears = inference_linears(model, device, spec["dtype"], spec["packed_linears"])
    if spec["measurement"] == "forward":
        call = forward_call(model, tokens, device, spec["dtype"], linears)
    elif spec["measurement"] == "train":
        call = train_call(model, model, tokens, device, spec["dtype"])
    else:
        call = decode_call(model, tokens, spec["decode_tokens"], spec["routing"], device, spec["dtype"],
                           linears=linears)
    state_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if device.type == "cuda":
        peak = _peak_cuda(call, device)
    elif device.type == "cpu":
        peak = _peak_rss(call)
    else:
        peak = None  # no sound per-process peak for this device type
    print(json.dumps({"peak_mem_bytes": None if peak is None else peak + state_bytes}))


def _peak_cuda(call: Callable[[], Any], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    for _ in range(2):  # the second training step also holds the optimizer state
        call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _peak_rss(call: Callable[[], Any]) -> int | None:
    """Rise of the peak resident set while `call` runs twice; None where Linux's /proc interface is missing."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so reusing them shows as a rise
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _proc_status_bytes("VmRSS")
    except OSError:
        return None
    for _ in range(2):
        call()
    return _proc_status_bytes("VmHWM") - base


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")

