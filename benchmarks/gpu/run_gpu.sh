#!/usr/bin/env bash
# GPU capacity run for the Nemotron 3.5 ASR architecture (builtin:nemotron-0.6b, random weights):
# step_bench (engine vs NeMo 3.0 pipeline vs NeMo's per-stream loop) and a server sweep at
# 80, 320 and 1120 ms in bf16 and fp32, on one CUDA machine without network.
#
#   benchmarks/gpu/run_gpu.sh OUT_DIR [WHEELS_DIR]
#
# Run from the repository root. With WHEELS_DIR, a fresh venv is made in /tmp and everything
# is installed from that folder only (--no-index); without it, the current Python is used as is.
# Results (JSON, PNG, logs, the exact commands) go to OUT_DIR. The run is budgeted: it stops
# starting new work when BUDGET_S (default 540 s) is close, so it ends inside 10 minutes even
# if a phase is slower than planned; what was skipped is listed in OUT_DIR/skipped.txt.
# See benchmarks/gpu/README.md (gathering the wheels, what each phase costs, reading results).
set -euo pipefail

OUT=${1:?usage: run_gpu.sh OUT_DIR [WHEELS_DIR]}
WHEELS=${2:-}
BUDGET_S=${BUDGET_S:-540}
MODEL=${MODEL:-builtin:nemotron-0.6b}
DEVICE=${DEVICE:-cuda}
MODES=${MODES:-"3 0 13"}            # right context: 320, 80, 1120 ms (the order is the priority)
DTYPES=${DTYPES:-"bf16 fp32"}
BATCHES=${BATCHES:-1,8,64,256}
LOOP_MAX_BATCH=${LOOP_MAX_BATCH:-8}  # NeMo's per-stream loop does not batch: a few streams suffice
SECONDS_PER_STREAM=${SECONDS_PER_STREAM:-8}
LEVEL_S=${LEVEL_S:-10}               # seconds per sweep level
LOADGEN_PROCS=${LOADGEN_PROCS:-6}
THREADS=${THREADS:-4}                # CPU threads of the bench process and of the server
SWEEP_COST_S=${SWEEP_COST_S:-75}     # start a sweep only with this much budget left
START_TIMEOUT=${START_TIMEOUT:-120}  # seconds for a server to load the model and answer /readyz

START=$(date +%s)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/run.log") 2>&1
: > "$OUT/skipped.txt"
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
note() { echo "[$(elapsed)s] $*"; }
run() { echo "$*" >> "$OUT/commands.txt"; note "$*"; "$@"; }

# ---------------------------------------------------------------------------- 1. environment
if [[ -n "$WHEELS" ]]; then
  VENV=/tmp/nemo-serve-gpu-venv
  python3 -m venv "$VENV"
  . "$VENV/bin/activate"
  run pip install -q --no-index --find-links "$WHEELS" setuptools wheel
  run pip install -q --no-index --find-links "$WHEELS" --no-build-isolation -e ".[bench]"
fi
PY=${PY:-python}
export NEMO_SERVE_BENCH_CACHE=${NEMO_SERVE_BENCH_CACHE:-/tmp/nemo-serve-bench}  # the 2.4 GB .nemo stays off OUT
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
(nvidia-smi || true) > "$OUT/nvidia-smi.txt" 2>&1
$PY - <<'EOF' | tee "$OUT/env.txt"
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
pip freeze > "$OUT/pip-freeze.txt" 2>/dev/null || true
note "environment ready"

# ---------------------------------------------------------------------------- 2. the model, built once
# Built on the CPU (random init + weight calibration): give it every core. On a busy 2-core box
# with one thread this took 24 min for nemotron-0.6b; pre-build it if the machine is kept.
OMP_NUM_THREADS=$(nproc) MKL_NUM_THREADS=$(nproc) \
  run $PY -c "import torch; torch.set_num_threads($(nproc)); from benchmarks.common import model_file; print(model_file('$MODEL')[0])" \
  | tee "$OUT/model_path.txt"
# Every later command gets this file, so the step bench and all sweeps measure the same weights.
MODEL_FILE=$(tail -n 1 "$OUT/model_path.txt")
[[ -f "$MODEL_FILE" ]] || { echo "no model file: $MODEL_FILE"; exit 1; }
note "model ready: $MODEL_FILE"

# ---------------------------------------------------------------------------- 3. step bench (one process per dtype: all modes)
MODES_CSV=$(echo $MODES | tr ' ' ',')
for dtype in $DTYPES; do
  if (( $(left) < 120 )); then echo "step_bench $dtype (budget)" >> "$OUT/skipped.txt"; continue; fi
  run timeout $(( $(left) - 60 )) $PY benchmarks/step_bench.py --model "$MODEL_FILE" --device "$DEVICE" --dtype "$dtype" \
      --context-right "$MODES_CSV" --batch-sizes "$BATCHES" --loop-max-batch "$LOOP_MAX_BATCH" \
      --seconds "$SECONDS_PER_STREAM" --systems engine,pipeline,loop --threads "$THREADS" --no-why \
      --out "$OUT/step_nemotron_${dtype}_r{r}.json" \
    || echo "step_bench $dtype (failed or timed out: see run.log)" >> "$OUT/skipped.txt"
done

# ---------------------------------------------------------------------------- 4. sweeps, in priority order
for r in $MODES; do
  for dtype in $DTYPES; do
    sb="$OUT/step_nemotron_${dtype}_r${r}.json"
    if (( $(left) < SWEEP_COST_S )); then echo "sweep r=$r $dtype (budget)" >> "$OUT/skipped.txt"; continue; fi
    if [[ ! -f "$sb" ]]; then echo "sweep r=$r $dtype (no step_bench result to size the levels)" >> "$OUT/skipped.txt"; continue; fi
    run timeout $(( $(left) - 15 )) $PY benchmarks/sweep.py --model "$MODEL_FILE" --device "$DEVICE" --dtype "$dtype" \
        --context-right "$r" --threads "$THREADS" --levels auto --step-bench "$sb" \
        --level-fractions 0.5,0.8,1.0,1.25 --duration "$LEVEL_S" --ramp-s 2 --items 8 --item-seconds 8,10 \
        --procs "$LOADGEN_PROCS" --start-timeout "$START_TIMEOUT" \
        --out "$OUT/sweep_nemotron_${dtype}_r${r}.json" \
      || echo "sweep r=$r $dtype (failed or timed out: see run.log)" >> "$OUT/skipped.txt"
  done
done

note "done in $(elapsed) s; skipped:"
cat "$OUT/skipped.txt"
