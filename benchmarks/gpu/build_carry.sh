#!/usr/bin/env bash
# Builds the folder the GPU run carries to a bare H200 (benchmarks/gpu/run_gpu.sh), here, with pip:
#   CARRY/wheels/  Python 3.12 x86-64 wheels of NeMo and of what the engine imports that the machine's
#                  image lacks (benchmarks/gpu/carry_packages.txt; versions from env/cpu.lock.txt;
#                  --no-deps: the image's torch, numpy, ... are used as they are there)
#   CARRY/cache/   the built-ins' trained tokenizers (NEMO_SERVE_CACHE there), so none is trained there
# and checks that it stays under the device tool's 64 MiB per call (with the working tree).
#
#   bash benchmarks/gpu/build_carry.sh [CARRY]      # default .gpu_carry (added to .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=${1:-.gpu_carry}
PY=${PY:-.venv/bin/python}
LIMIT_MIB=${LIMIT_MIB:-56}
mkdir -p "$CARRY/wheels" "$CARRY/cache"
grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >> .git/info/exclude

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
