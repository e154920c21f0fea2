"""An onnxruntime call right after an eager PyTorch call, against the same call after a pause and alone: how long
PyTorch's OpenMP threads, still spinning after their parallel region, slow the onnxruntime call that follows
(modcli.profiling.onnx.ONNXRUNTIME_SETTLE_S). Fresh small-preset models (dense and MoD), their fused forward
graphs exported as `modcli profile` does, batch B, T 256, 2 threads; for each pause, 15 rounds alternating eager and
onnxruntime (order flipped every round), the pause taken untimed before every onnxruntime call that follows an eager
one; then 15 calls of each alone:

    python bench/ort_after_eager.py [batch]
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
from modcli_runtime.bundle import create_session

from modcli.bundle.fusion import fuse_graph
from modcli.bundle.lowering import MIN_OPSET, export_onnx, export_program, forward_spec
from modcli.config import PRESETS, ModelConfig
from modcli.models.build import build_model
from modcli.packed_linear import inference_linears
from modcli.profiling.onnx import SESSION_SPINNING, SESSION_STOP_SPINNING

ROUNDS = 15
PAUSES_MS = (0, 1, 3, 10, 20)


def median_ms(seconds: list[float]) -> float:
    return 1000 * sorted(seconds)[len(seconds) // 2]


def measure(label: str, route_every: int, batch: int, folder: Path) -> list[str]:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    torch.manual_seed(0)
    config = ModelConfig(**{k: v for k, v in PRESETS["small"].items() if k in fields}, route_every=route_every)
    model = build_model(config).eval()
    tokens = torch.randint(0, config.vocab_size, (batch, 256))
    spec = forward_spec(model)
    path = folder / f"{label}.onnx"
    export_onnx(spec, export_program(spec), path, MIN_OPSET)
    fuse_graph(path, config.n_heads, config.d_model)
    session = create_session(path, ["CPUExecutionProvider"], threads=torch.get_num_threads(),
                             spinning=SESSION_SPINNING, stop_spinning=SESSION_STOP_SPINNING)
    feeds = {spec.input_names[0]: tokens.numpy()}
    routing = "router" if route_every else None
    calls = {"onnxruntime": lambda: session.run(None, feeds), "eager": lambda: model(tokens, routing)}

    previous = [None]

    def timed(name: str, pause_s: float) -> float:
        if pause_s and name == "onnxruntime" and previous[0] == "eager":
            time.sleep(pause_s)
        previous[0] = name
        start = time.perf_counter()
        calls[name]()
        return time.perf_counter() - start

    lines = []
    with torch.no_grad(), inference_linears(model, torch.device("cpu"), "float32", None):
        for _ in range(3):
            for call in calls.values():
                call()
        for pause_ms in PAUSES_MS:
            times: dict[str, list[float]] = {name: [] for name in calls}
            for round_ in range(ROUNDS):
                for name in (list(calls) if round_ % 2 else list(calls)[::-1]):
                    times[name].append(timed(name, pause_ms / 1000))
            ort, eager = median_ms(times["onnxruntime"]), median_ms(times["eager"])
            lines.append(f"{label} batch {batch}, interleaved, pause {pause_ms} ms: onnxruntime {ort:.2f} ms, "
                         f"eager {eager:.2f} ms, onnxruntime / eager {ort / eager:.3f}")
        alone = {name: median_ms([timed(name, 0) for _ in range(ROUNDS)]) for name in calls}
    lines.append(f"{label} batch {batch}, alone: onnxruntime {alone['onnxruntime']:.2f} ms, eager {alone['eager']:.2f} "
                 f"ms, onnxruntime / eager {alone['onnxruntime'] / alone['eager']:.3f}")
    return lines


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="modcli-ort-after-eager-") as tmp:
        for label, route_every in (("dense", 0), ("mod", 2)):
            for line in measure(label, route_every, batch, Path(tmp)):
                print(line, flush=True)


if __name__ == "__main__":
    main()
