#!/usr/bin/env bash
# Measure trained small-preset runs of several model families against the dense twin: causal validation loss
# (`modcli eval`), training-step, forward and decode-step latency ratios (`modcli profile --compare dense`, batch 8,
# T = 256, MoD and dense interleaved, medians), and greedy generation (KV bytes stored against dense).
#
#   bench/families.sh runs/small-moe runs/small-staged runs/small-integrated runs/small-recursion
#   OUT=/tmp/x REPEATS=7 bench/families.sh runs/small-topk
#
# Writes <run name>.eval.json, .profile.json and .generate.json under $OUT (default bench/results/families) and
# prints one summary row per run (bench/families_table.py). Each profile waits for a quiet CPU first
# (bench/wait_quiet.py): other processes disturb CPU timings badly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MODCLI=${MODCLI:-.venv/bin/modcli}
[ -x "$MODCLI" ] || MODCLI=modcli
OUT=${OUT:-bench/results/families}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT"
for run in "$@"; do
  name=$(basename "$run")
  "$MODCLI" eval "$run" --batches 16 --batch-size 8 --json > "$OUT/$name.eval.json"
  "$MODCLI" generate "$run" --prompt "def " --max-new-tokens 200 --temperature 0 --json > "$OUT/$name.generate.json"
  "$PY" bench/wait_quiet.py --max-wait 60 || true
  "$MODCLI" profile "$run" --compare dense --batch-size 8 --measure forward,train,decode --repeats "$REPEATS" \
    --no-memory --json > "$OUT/$name.profile.json"
done
"$PY" bench/families_table.py "$OUT" "$@"
