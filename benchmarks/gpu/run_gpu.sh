#!/usr/bin/env bash
# The GPU run, ONE command for a bare lent H100/H200 (Python 3.12, its own CUDA torch, no NeMo, no
# network), its phases in the order of their value, each time-boxed, the whole inside one device
# command (600 s at most; ~9.5 min of wall, ~11 min of device time with the machine's start):
#
#   benchmarks/gpu/run_gpu.sh OUT [gpu_bench.py options]        # from the repository root
#
#   0. setup     (~20 s)  carried wheels (CARRY/wheels, build_carry.sh) into /tmp/site; OUT/env.txt
#   1. profile   PROFILE_S (130)  profile_step.py: where each GPU millisecond of a step goes (OUT/profile/)
#   2. bench     the rest of BUDGET_S (470, from the start: ~320 s), gpu_bench.py, its phases boxed by --phase-ends:
#                preflight; --selftest of every new path in fp32 and bf16 (demo + tiny-prompt); checks
#                (graphs vs eager on the ring pool, step sweep); capacity reference vs candidate
#                defaults; the overlapped loop on/off; streams per GPU with diarization on
#   3. server    SERVER_LOAD_S (90): server_capacity.py, the real server (6 front ends), each level
#                (SERVER_LEVEL_S 6 s) through uvicorn's /ws, then picows's (--fast-ws-port) when picows
#                imports (carried), beside the engine-only figure
#   4. decide    decide.py: OUT/decision.json, which CUDA defaults the results support switching
# Every phase writes its JSON under OUT as it finishes (results.jsonl line by line), so a command
# killed at its limit keeps what ran; WALL_S (570) caps the server phase so the whole stays inside 600 s.
# OUT holds at most 8 files (the device tool's limit): results.jsonl, run.log, decision.json,
# server_capacity.json, profile/{profile.json,summary.txt}, extra.tar.gz (env.txt, the profile's
# trace, the server's log, diagnose.log: repacked after each phase).
#
# Switches: PROFILE (on when DEVICE=cuda), PROFILE_ONLY=1 (the profile alone), SERVER_LOAD (on when
# DEVICE=cuda), SERVER_LOAD_ONLY=1 (that phase alone on an earlier OUT), SERVER_LOAD_ARGS (its extra
# options), DECIDE (on when DEVICE=cuda). If the preflight fails (exit 4), diagnose.py finds which
# graph path fails and the bench runs again with the first variant that works.
# CPU dry run (tests/test_gpu_dry_run.py): DEVICE=cpu DTYPE=fp32 and small options.
set -uo pipefail

OUT=${1:?usage: run_gpu.sh OUT [gpu_bench.py options]}
shift
CARRY=${CARRY:-.gpu_carry}
BUDGET_S=${BUDGET_S:-470}
WALL_S=${WALL_S:-570}
MODEL=${MODEL:-nemotron-0.6b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
PY=${PY:-python3}
on_cuda=$([[ $DEVICE == cuda ]] && echo 1 || echo 0)
PROFILE=${PROFILE:-$on_cuda}
PROFILE_S=${PROFILE_S:-130}
SERVER_LOAD=${SERVER_LOAD:-$on_cuda}
DECIDE=${DECIDE:-$on_cuda}
START=$(date +%s)
EXTRA=${EXTRA:-$(mktemp -d /tmp/gpu_run_extra.XXXX)}
# what the results record as their command and commit (the machine's copy may have no .git:
# build_carry.sh wrote the commit into the carried folder)
export NEMO_SERVE_RUN_COMMAND=${NEMO_SERVE_RUN_COMMAND:-"BUDGET_S=$BUDGET_S bash benchmarks/gpu/run_gpu.sh OUT $*"}
export NEMO_SERVE_GIT_COMMIT=${NEMO_SERVE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat "$CARRY/commit" 2>/dev/null || echo "?")}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[$(elapsed)s] $*"; }
pack() {  # the secondary files into one archive, so OUT stays within the device tool's 8 files
  for f in "$OUT"/env.txt "$OUT"/diagnose.log "$OUT"/server_capacity.server.log "$OUT"/profile/trace_*; do
    [[ -e "$f" ]] && mv "$f" "$EXTRA/"
  done
  tar czf "$OUT/extra.tar.gz" -C "$EXTRA" . 2>/dev/null
}

# 0. setup: the image as it is, before anything is carried in
{ (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true); $PY -V; uname -m;
  echo "# pip list of the image"; $PY -m pip list --format=freeze 2>/dev/null; } > "$OUT/env.txt" 2>&1
if [[ -d "$CARRY/wheels" ]] && compgen -G "$CARRY/wheels/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/wheels/*.whl \
    || { echo "wheel install failed"; pack; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  { echo "# carried into /tmp/site"; $PY -m pip list --format=freeze --path /tmp/site 2>/dev/null; } >> "$OUT/env.txt" 2>&1
fi
[[ -d "$CARRY/cache" ]] && export NEMO_SERVE_CACHE="$(cd "$CARRY/cache" && pwd)"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
# The KV layout the checks and step sweep run with (engine/ring_cache.py; CUDA's default stays the window
# until decide.py says otherwise); the selftest and capacity phases pick every path themselves.
export NEMO_SERVE_KV_LAYOUT=${NEMO_SERVE_KV_LAYOUT:-ring}
export PYTHONUNBUFFERED=1  # PYTORCH_CUDA_ALLOC_CONF is left to the caller: expandable segments with graph pools is untested here
pack
say "environment ready"

bench() {  # gpu_bench.py with what is left of the budget (its phases boxed inside it by --phase-ends)
  local left=$(( BUDGET_S - $(elapsed) ))
  timeout $(( left + 20 )) "$@" $PY benchmarks/gpu/gpu_bench.py --out "$OUT" --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --budget-s "$left" --level-seconds "${LEVEL_S:-5}" "${ARGS[@]}"
}
server_load() {  # the real server through sockets, at the bench's settings (its results.jsonl)
  local budget=${SERVER_LOAD_S:-90}
  local room=$(( WALL_S - $(elapsed) - 25 ))
  if (( room < 40 )); then say "server phase skipped: ${room}s left of WALL_S"; return 0; fi
  (( room < budget )) && budget=$room
  local fast=()
  if $PY -c "import picows" 2>/dev/null; then fast=(--fast-ws); else say "picows does not import: uvicorn's /ws only"; fi
  # shellcheck disable=SC2086 - SERVER_LOAD_ARGS is option words
  timeout $(( budget + 20 )) $PY benchmarks/gpu/server_capacity.py --out "$OUT" --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --budget-s "$budget" --level-seconds "${SERVER_LEVEL_S:-6}" "${fast[@]}" ${SERVER_LOAD_ARGS:-}
  local src=$?
  say "server_capacity.py exit $src"
  return $src
}
decide() {
  [[ $DECIDE == 1 ]] || return 0
  $PY benchmarks/gpu/decide.py "$OUT"
  say "decide.py exit $?"
}
ARGS=("$@")
if [[ ${SERVER_LOAD_ONLY:-0} == 1 ]]; then
  server_load
  src=$?
  pack
  exit $src
fi
# 1. profile before timing anything (issue 46): its output is what the next change needs
if [[ $PROFILE == 1 ]]; then
  timeout "$PROFILE_S" $PY benchmarks/gpu/profile_step.py --out "$OUT/profile" --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --budget-s $(( PROFILE_S - 20 ))
  prc=$?
  say "profile_step.py exit $prc"
  pack
  [[ ${PROFILE_ONLY:-0} == 1 ]] && exit $prc
fi
# 2. the bench: selftests, checks, capacity, overlap, diarization
bench env
rc=$?
say "gpu_bench.py exit $rc"
if [[ $rc == 4 ]]; then
  # The preflight failed: find which part of the graph path fails (benchmarks/gpu/diagnose.py), and
  # if a configuration runs and matches eager, measure with it rather than not at all.
  timeout 200 $PY benchmarks/gpu/diagnose.py --out "$OUT" --dtype "$DTYPE" --device "$DEVICE" | tee "$OUT/diagnose.log"
  chosen=$(grep '^CHOSEN ' "$OUT/diagnose.log" | tail -1 | cut -d' ' -f2-)
  say "diagnosis: ${chosen:-NONE (the failure did not reproduce there)}"
  if [[ -n "$chosen" && "$chosen" != NONE ]]; then
    # shellcheck disable=SC2086 - chosen is VAR=value words
    bench env $chosen
    rc=$?
    say "gpu_bench.py with $chosen exit $rc"
  fi
fi
pack
# 3. the real server (its status is logged; the run's is the bench's)
[[ $SERVER_LOAD == 1 ]] && server_load
pack
# 4. which defaults the results support switching
decide
exit $rc
