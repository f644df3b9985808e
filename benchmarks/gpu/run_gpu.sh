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
# PROFILE (default: on when DEVICE=cuda) runs benchmarks/gpu/profile_step.py FIRST, before the
# bench, bounded by PROFILE_S (default 240; the script budgets itself 20 s less): where each
# millisecond of a step goes, into OUT/profile/{profile.json,summary.txt,trace_*.json.gz}. The
# bench then gets what is left of BUDGET_S, so profile + bench stay inside one device call.
# PROFILE_ONLY=1: the profile alone (exit with its status), for a call that has time for nothing else.
# SERVER_LOAD=1 (default off; issue 46 step 7): after the bench, benchmarks/gpu/server_capacity.py
# starts the real server on the bench's model and settings and drives it with the multi-process load
# generator, bounded by SERVER_LOAD_S (default 120) plus 20 s; OUT/server_capacity.json beside
# results.jsonl. SERVER_LOAD_ARGS: extra options for it (e.g. "--mode 3 --levels 2000,4000").
# SERVER_LOAD_ONLY=1: that phase alone, on an OUT whose results.jsonl an earlier call wrote.
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
PROFILE=${PROFILE:-$([[ $DEVICE == cuda ]] && echo 1 || echo 0)}
PROFILE_S=${PROFILE_S:-240}
START=$(date +%s)
# what the results record as their command and commit (the machine's copy may have no .git:
# build_carry.sh wrote the commit into the carried folder)
export NEMO_SERVE_RUN_COMMAND=${NEMO_SERVE_RUN_COMMAND:-"BUDGET_S=$BUDGET_S bash benchmarks/gpu/run_gpu.sh OUT $*"}
export NEMO_SERVE_GIT_COMMIT=${NEMO_SERVE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat "$CARRY/commit" 2>/dev/null || echo "?")}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1

# the image as it is, before anything is carried in
{ (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true); $PY -V; uname -m;
  echo "# pip list of the image"; $PY -m pip list --format=freeze 2>/dev/null; } > "$OUT/env.txt" 2>&1
if [[ -d "$CARRY/wheels" ]] && compgen -G "$CARRY/wheels/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/wheels/*.whl \
    || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  { echo "# carried into /tmp/site"; $PY -m pip list --format=freeze --path /tmp/site 2>/dev/null; } >> "$OUT/env.txt" 2>&1
fi
[[ -d "$CARRY/cache" ]] && export NEMO_SERVE_CACHE="$(cd "$CARRY/cache" && pwd)"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
# The KV layout the checks and step sweep run with (engine/ring_cache.py; opt-in on the CPU until this
# run confirms it on the device); the selftest and capacity run both layouts themselves.
export NEMO_SERVE_KV_LAYOUT=${NEMO_SERVE_KV_LAYOUT:-ring}
export PYTHONUNBUFFERED=1  # PYTORCH_CUDA_ALLOC_CONF is left to the caller: expandable segments with graph pools is untested here
echo "[$(( $(date +%s) - START ))s] environment ready"

bench() {  # gpu_bench.py with what is left of the budget
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  timeout $(( left + 20 )) "$@" $PY benchmarks/gpu/gpu_bench.py --out "$OUT" --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --budget-s "$left" "${ARGS[@]}"
}
server_load() {  # the real server through sockets, at the bench's settings (its results.jsonl)
  local budget=${SERVER_LOAD_S:-120}
  # shellcheck disable=SC2086 - SERVER_LOAD_ARGS is option words
  timeout $(( budget + 20 )) $PY benchmarks/gpu/server_capacity.py --out "$OUT" --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --budget-s "$budget" ${SERVER_LOAD_ARGS:-}
  local src=$?
  echo "[$(( $(date +%s) - START ))s] server_capacity.py exit $src"
  return $src
}
ARGS=("$@")
if [[ ${SERVER_LOAD_ONLY:-0} == 1 ]]; then
  server_load
  exit $?
fi
if [[ $PROFILE == 1 ]]; then  # profile before timing anything (issue 46): its output is what the next change needs
  timeout "$PROFILE_S" $PY benchmarks/gpu/profile_step.py --out "$OUT/profile" --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --budget-s $(( PROFILE_S - 20 ))
  prc=$?
  echo "[$(( $(date +%s) - START ))s] profile_step.py exit $prc"
  [[ ${PROFILE_ONLY:-0} == 1 ]] && exit $prc
fi
bench env
rc=$?
echo "[$(( $(date +%s) - START ))s] gpu_bench.py exit $rc"
if [[ $rc == 4 ]]; then
  # The preflight failed: find which part of the graph path fails (benchmarks/gpu/diagnose.py), and
  # if a configuration runs and matches eager, measure with it rather than not at all.
  timeout 200 $PY benchmarks/gpu/diagnose.py --out "$OUT" --dtype "$DTYPE" --device "$DEVICE" | tee "$OUT/diagnose.log"
  chosen=$(grep '^CHOSEN ' "$OUT/diagnose.log" | tail -1 | cut -d' ' -f2-)
  echo "[$(( $(date +%s) - START ))s] diagnosis: ${chosen:-NONE (the failure did not reproduce there)}"
  if [[ -n "$chosen" && "$chosen" != NONE ]]; then
    # shellcheck disable=SC2086 - chosen is VAR=value words
    bench env $chosen
    rc=$?
    echo "[$(( $(date +%s) - START ))s] gpu_bench.py with $chosen exit $rc"
  fi
fi
[[ ${SERVER_LOAD:-0} == 1 ]] && server_load  # its status is logged; the run's is the bench's
exit $rc
