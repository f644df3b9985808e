#!/usr/bin/env bash
# The GPU run for a bare lent H200 (Python 3.12, its own CUDA torch, no NeMo, no network): installs
# the carried wheels into /tmp/site, records the image's packages, then runs
# benchmarks/gpu/gpu_bench.py: a preflight of at most ~30 s that stops the run (exit 4) with a plain
# message if anything is wrong, self-checks (parity with NeMo's loop, graphs against eager, device
# waits), then the measurements; every result is appended to OUT/results.jsonl as soon as it exists
# (a killed run keeps what it measured).
#
#   benchmarks/gpu/run_gpu.sh OUT [gpu_bench.py options]        # from the repository root
#
# CARRY (default .gpu_carry, made here by benchmarks/gpu/build_carry.sh and named in the device
# tool's `carry`): wheels/ (NeMo and what it imports that the machine lacks) and cache/ (the
# built-ins' trained tokenizers, so nothing is trained there). Without CARRY/wheels the current
# Python is used as it is. BUDGET_S (default 420: a first run that fails early still leaves a
# complete second run inside the device's 15 minutes) bounds gpu_bench.py: each phase starts only
# if it fits, and `timeout` kills it 20 s after. Results: OUT/results.jsonl, OUT/run.log,
# OUT/env.txt (GPU, Python, every installed package with its version).
# CPU dry run (tests/test_gpu_dry_run.py): DEVICE=cpu DTYPE=fp32 MODEL=tiny-prompt and small options.
set -uo pipefail

OUT=${1:?usage: run_gpu.sh OUT [gpu_bench.py options]}
shift
CARRY=${CARRY:-.gpu_carry}
BUDGET_S=${BUDGET_S:-420}
MODEL=${MODEL:-nemotron-0.6b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
PY=${PY:-python3}
START=$(date +%s)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1

if [[ -d "$CARRY/wheels" ]] && compgen -G "$CARRY/wheels/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/wheels/*.whl \
    || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[[ -d "$CARRY/cache" ]] && export NEMO_SERVE_CACHE="$(cd "$CARRY/cache" && pwd)"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1  # PYTORCH_CUDA_ALLOC_CONF is left to the caller: expandable segments with graph pools is untested here
{ (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true); $PY -V; uname -m;
  echo "# pip list (the image, and what was carried into /tmp/site)"; $PY -m pip list --format=freeze 2>/dev/null;
  [[ -d /tmp/site ]] && $PY -m pip list --format=freeze --path /tmp/site 2>/dev/null | sed 's/^/carried: /'; } > "$OUT/env.txt" 2>&1
echo "[$(( $(date +%s) - START ))s] environment ready"

LEFT=$(( BUDGET_S - ($(date +%s) - START) ))
timeout $(( LEFT + 20 )) $PY benchmarks/gpu/gpu_bench.py --out "$OUT" --model "$MODEL" --device "$DEVICE" \
  --dtype "$DTYPE" --budget-s "$LEFT" "$@"
rc=$?
echo "[$(( $(date +%s) - START ))s] gpu_bench.py exit $rc"
exit $rc
