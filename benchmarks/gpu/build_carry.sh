#!/usr/bin/env bash
# Builds the folder the GPU run carries to a bare H200 (benchmarks/gpu/run_gpu.sh), here, with pip:
#   CARRY/wheels/  Python 3.12 x86-64 wheels of NeMo and of what the engine imports that the machine's
#                  image lacks or holds in a version NeMo cannot use (benchmarks/gpu/carry_packages.txt;
#                  versions from env/cpu.lock.txt; --no-deps: the image's torch, numpy, ... are used
#                  as they are there)
#   CARRY/cache/   the built-ins' trained tokenizers (NEMO_SERVE_CACHE there), so none is trained there
# checks that it stays under the device tool's 64 MiB per call (with the working tree), then checks
# that it imports against the image's versions: benchmarks/gpu/simulate_image.sh (Python 3.12, torch
# 2.11, image_versions.txt, these wheels installed as run_gpu.sh installs them; imports NeMo and the
# engine, builds tiny-prompt on CPU) when its environment SIM exists (it is built once by running
# simulate_image.sh itself, 7 GB); otherwise it says that the carry is unchecked against the image.
#
#   bash benchmarks/gpu/build_carry.sh [CARRY]      # default .gpu_carry (added to .git/info/exclude)
#   SIM=DIR (default ~/.cache/nemo-serve/imgsim, as simulate_image.sh's); SIMULATE=0 skips the check
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=${1:-.gpu_carry}
PY=${PY:-.venv/bin/python}
LIMIT_MIB=${LIMIT_MIB:-56}
rm -rf "$CARRY/wheels"   # no stale version of a wheel: two of one package stop the install there
mkdir -p "$CARRY/wheels" "$CARRY/cache"
git rev-parse --short HEAD > "$CARRY/commit"  # run_gpu.sh stamps its results with it
exclude=$(git rev-parse --git-path info/exclude)   # also in a worktree, where .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx "/$CARRY/" "$exclude" 2>/dev/null || echo "/$CARRY/" >> "$exclude"

specs=()
while read -r name; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  pin=$(grep -i -E "^${name//-/[-_]}==" env/cpu.lock.txt | head -1 || true)
  [[ -n "$pin" ]] || { echo "not in env/cpu.lock.txt: $name"; exit 1; }
  specs+=("$pin")
done < benchmarks/gpu/carry_packages.txt
plats=()
for n in 17 24 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
for spec in "${specs[@]}"; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "${plats[@]}" -d "$CARRY/wheels" "$spec" 2>/dev/null \
  || $PY -m pip wheel -q --no-deps -w "$CARRY/wheels" "$spec" 2>/dev/null \
  || { echo "no wheel for $spec"; exit 1; }   # an sdist only (antlr4 4.9.3): built here, pure Python
done
bad=$(ls "$CARRY/wheels" | grep -v -E -- '-(py3|py2.py3|py312|cp312)-' || true)
[[ -z "$bad" ]] || { echo "wheels not for Python 3.12: $bad"; exit 1; }

# tokenizers of the built-ins the GPU run may build
NEMO_SERVE_CACHE="$(cd "$CARRY/cache" && pwd)" PYTHONPATH=. $PY - <<'PYEOF'
from nemo_serve.builtin import builtin_spec
from nemo_serve.builtin.tokenizer import ensure_tokenizer
for name in ("nemotron-0.6b", "tiny-prompt"):
    print(ensure_tokenizer(name, builtin_spec(name).tokenizer))
PYEOF

size=$(du -sm "$CARRY" | cut -f1)
echo "$CARRY: $(ls "$CARRY/wheels" | wc -l) wheels, ${size} MiB"
(( size <= LIMIT_MIB )) || { echo "over ${LIMIT_MIB} MiB: the tree and this folder must fit 64 MiB together"; exit 1; }

# the import check against the image's versions (not against env/cpu.lock.txt's)
SIM=${SIM:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-serve/imgsim}
if [[ "${SIMULATE:-1}" == 0 ]]; then
  echo "import check against the image skipped (SIMULATE=0)"
elif [[ -x "$SIM/venv/bin/python" ]]; then
  bash benchmarks/gpu/simulate_image.sh "$SIM" "$CARRY" || { echo "the carry does not import on the simulated image"; exit 1; }
else
  echo "NOT checked against the image's versions: no simulated image at $SIM;" \
       "build it once with: bash benchmarks/gpu/simulate_image.sh $SIM $CARRY (7 GB, 2-4 min)"
fi
