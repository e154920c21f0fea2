#!/usr/bin/env bash
# A short, prepared GPU benchmark for a lent accelerator (about 5 minutes on one H200). It profiles MoD against its
# dense twin over a few shapes and writes everything into $OUT (at most 8 files come back from the device tool):
#
#   nvidia-smi.txt, gpu_small_bf16.json, gpu_base_bf16.json, gpu_base_fp32.json,
#   gpu_base_bf16_compiled.json (eager and torch.compile side by side: forward, causal prefill, and the static-shape
#   decode step as a CUDA graph), gpu_small_fp32_onnx.json (eager against the exported, fused ONNX graphs on
#   onnxruntime's CUDA execution provider: forward and decode step), summary.md, log.txt
#
# Run from the repository root, e.g. through the device tool:  OUT=$OUT bash bench/gpu.sh
# Try it on a CPU with tiny shapes:  DEVICE=cpu SMOKE=1 OUT=/tmp/gpu-smoke bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder for the results}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
SMOKE=${SMOKE:-0}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1

if [ "$SMOKE" = 1 ]; then
  SMALL=(--preset tiny --seq-lens 32,64); BASE=(--preset tiny --d-model 64 --seq-lens 32,64)
  BASE_FP32=(--preset tiny --d-model 64 --seq-lens 32); ONE=(--preset tiny --seq-len 64)
  SMALL_ONNX=(--preset tiny --seq-lens 32)
  COMMON=(--batch-size 2 --repeats 2 --warmup 1 --decode-tokens 4)
else
  SMALL=(--preset small --seq-lens 256,1024,4096); BASE=(--preset base --seq-lens 512,1024,2048,4096)
  BASE_FP32=(--preset base --seq-lens 1024,2048); ONE=(--preset base --seq-len 2048)
  SMALL_ONNX=(--preset small --seq-lens 256,1024)
  COMMON=(--batch-size 8 --repeats 7 --warmup 3 --decode-tokens 64)
fi
profile() {  # a name, a time limit in seconds, then flags
  local name=$1 limit=$2; shift 2
  echo "== $name: modcli profile $*"
  timeout "$limit" "$PY" -m modcli profile --device "$DEVICE" "${COMMON[@]}" "$@" --json > "$OUT/$name.json" \
    || echo "!! $name failed or ran out of time (exit $?)"
}

{ nvidia-smi || true; "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
  > "$OUT/nvidia-smi.txt" 2>&1
profile gpu_small_bf16 120 "${SMALL[@]}" --dtype bfloat16
profile gpu_base_bf16 150 "${BASE[@]}" --dtype bfloat16
profile gpu_base_fp32 90 "${BASE_FP32[@]}" --dtype float32 --no-memory
profile gpu_base_bf16_compiled 300 "${ONE[@]}" --dtype bfloat16 --backends eager,compiled --measure forward,decode \
  --no-memory
profile gpu_small_fp32_onnx 150 "${SMALL_ONNX[@]}" --dtype float32 --backends eager,onnxruntime --measure forward,decode \
  --no-memory

"$PY" - "$OUT" > "$OUT/summary.md" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = []  # (path, profile) of every result that came back whole
for path in sorted(out.glob("gpu_*.json")):
    try:
        runs.append((path, json.loads(path.read_text())))
    except ValueError:
        continue
print("| run | T | fwd ms MoD/dense | fwd ratio (ideal) | train ms MoD/dense | train ratio (ideal) | decode ms/step "
      "MoD/dense | decode ratio (ideal) | KV ratio | peak mem train MoD/dense MiB |")
print("|---|---|---|---|---|---|---|---|---|---|")
for path, p in runs:
    for r in p["results"]:
        cells = [f"{path.stem} ({p['device_name']}, batch {p['batch_size']})", str(r["seq_len"])]
        for name in ("forward", "train_step", "decode"):
            m, b, q = r["model"][name], r["baseline"][name], r["ratio"].get(f"{name}_latency")
            if m is None or q is None:
                cells += ["-", "-"]
                continue
            cells += [f"{m['latency_ms']:.2f} / {b['latency_ms']:.2f}", f"{q['measured']:.3f} ({q['ideal']:.3f})"]
        kv = r["ratio"].get("kv_cache")
        cells.append(f"{kv['measured']:.3f}" if kv else "-")
        m, b = r["model"]["train_step"], r["baseline"]["train_step"]
        mem = m and m["peak_mem_bytes"] and f"{m['peak_mem_bytes'] / 2**20:.0f} / {b['peak_mem_bytes'] / 2**20:.0f}"
        cells.append(mem or "-")
        print("| " + " | ".join(cells) + " |")
print()
print("| run | T | backend | measurement | MoD ms | dense ms | ratio | FLOP ideal | compile s MoD/dense |")
print("|---|---|---|---|---|---|---|---|---|")
for path, p in runs:
    for r in p["results"]:
        for backend in p.get("backends", ["eager"]):
            for name in ("forward", "train_step", "prefill", "decode"):
                m = r["model"][name] if backend == "eager" else r["model"].get(backend, {}).get(name)
                b = r["baseline"][name] if backend == "eager" else r["baseline"].get(backend, {}).get(name)
                q = r["ratio"].get(f"{name}_latency" if backend == "eager" else f"{backend}_{name}_latency")
                if not m or not b or not q or len(p.get("backends", [])) < 2:
                    continue
                compile_s = " / ".join(f"{t['compile_s']:.1f}" for t in (m, b) if t.get("compile_s")) or "-"
                print(f"| {path.stem} | {r['seq_len']} | {backend} | {name} | {m['latency_ms']:.2f} | "
                      f"{b['latency_ms']:.2f} | {q['measured']:.3f} | {q['ideal']:.3f} | {compile_s} |")
PY
cat "$OUT/summary.md"
