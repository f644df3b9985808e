#!/usr/bin/env bash
# The H200 image simulated here, on CPU: does the carried folder import there?
#
#   bash benchmarks/gpu/simulate_image.sh [SIM] [CARRY]   # from anywhere; SIM default
#                                                         # ~/.cache/nemo-serve/imgsim, CARRY .gpu_carry
#
# 1. SIM/venv: a Python 3.12 virtual environment with exactly the image's packages
#    (benchmarks/gpu/image_versions.txt: torch 2.11.0 from PyPI, the CUDA 13 build, with its nvidia-*
#    libraries, which it needs to import; it runs on CPU here), installed with --no-deps, as the
#    image holds them. Built once (7.0 GB, 2-4 min here), rebuilt when image_versions.txt changes.
# 2. CARRY/wheels installed into SIM/site with run_gpu.sh's own command (pip --no-index --no-deps
#    --target), on PYTHONPATH before the repository, as run_gpu.sh does; NEMO_SERVE_CACHE=CARRY/cache.
# 3. Imports nemo.collections.asr, the engine (nemo_serve.engine.step, .loop), nemo_serve.selftest and
#    benchmarks.architecture; builds builtin:tiny-prompt (construct/served, fp32, CPU) and runs one
#    step of it; prints where lightning, torch, numpy, ... were imported from. Exit 0 when all pass.
# PY312: the Python 3.12 to build the venv with (default: python3.12 on PATH, else pyenv's newest 3.12).
# Not part of CI (it downloads ~5 GB once).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
SIM=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-serve/imgsim}
SIM=$(mkdir -p "$SIM" && cd "$SIM" && pwd)
CARRY=${2:-$REPO/.gpu_carry}
[[ -d "$CARRY/wheels" ]] || { echo "no $CARRY/wheels: run benchmarks/gpu/build_carry.sh first"; exit 2; }
CARRY=$(cd "$CARRY" && pwd)
VERSIONS=$REPO/benchmarks/gpu/image_versions.txt
T0=$(date +%s)

stamp=$(sha256sum "$VERSIONS" | cut -c1-16)
if [[ "$(cat "$SIM/venv/.image_versions" 2>/dev/null)" != "$stamp" ]]; then
  if [[ -z "${PY312:-}" ]]; then   # the first that runs as 3.12 (a pyenv shim may not)
    for c in $(command -v python3.12 || true) $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3 2>/dev/null | sort -rV); do
      "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { PY312=$c; break; }
    done
  fi
  [[ -n "${PY312:-}" ]] || { echo "no Python 3.12 found (set PY312)"; exit 2; }
  echo "building $SIM/venv with $($PY312 -V) and image_versions.txt (--no-deps)"
  rm -rf "$SIM/venv"
  "$PY312" -m venv "$SIM/venv"
  "$SIM/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-compile -r "$VERSIONS" \
    > "$SIM/install.log" 2>&1 || { grep -v "^WARNING: Location" "$SIM/install.log" | tail -20; echo "image install failed"; exit 2; }
  echo "$stamp" > "$SIM/venv/.image_versions"
  echo "[$(( $(date +%s) - T0 ))s] image environment built"
fi
PY=$SIM/venv/bin/python

# run_gpu.sh's install, verbatim but for the target folder
T1=$(date +%s)
rm -rf "$SIM/site"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SIM/site" "$CARRY"/wheels/*.whl \
  || { echo "wheel install failed"; exit 3; }
echo "[$(( $(date +%s) - T1 ))s] $(ls "$CARRY"/wheels/*.whl | wc -l) carried wheels installed into $SIM/site"

T2=$(date +%s)
cd "$REPO"
NEMO_SERVE_CACHE="$CARRY/cache" PYTHONPATH="$SIM/site:$REPO" PYTHONUNBUFFERED=1 $PY - "$SIM/site" <<'PYEOF'
import importlib, sys, time, warnings
warnings.filterwarnings("ignore")
site = sys.argv[1]
t = time.time()
for mod in ("torch", "nemo.collections.asr", "nemo_serve.engine.step", "nemo_serve.engine.loop",
            "nemo_serve.selftest", "benchmarks.architecture"):
    t1 = time.time()
    importlib.import_module(mod)
    print(f"import {mod}: ok ({time.time() - t1:.1f} s)")
import importlib.metadata as md
for name in ("torch", "numpy", "lightning", "pytorch_lightning", "torchmetrics", "transformers",
             "huggingface_hub", "omegaconf", "nemo", "pydantic", "protobuf"):
    try:
        mod = {"protobuf": "google.protobuf"}.get(name, name)
        m = importlib.import_module(mod)
        where = "carried" if m.__file__.startswith(site) else "image"
        print(f"  {name} {getattr(m, '__version__', '?')} ({where})")
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: {type(e).__name__}: {e}")
print(f"imports: {time.time() - t:.1f} s")
# informational: what the carried wheels ask for that the image + carry do not meet (--no-deps there)
from packaging.requirements import Requirement
dists = {}
for d in md.distributions():
    dists.setdefault(d.metadata["Name"].lower().replace("_", "-"), d)
for name, d in sorted(dists.items()):
    if not str(d._path).startswith(site):
        continue
    for r in d.requires or []:
        req = Requirement(r)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        have = dists.get(req.name.lower().replace("_", "-"))
        if have is None:
            print(f"  unmet (absent; the imports above do not need it): {name} requires {r}")
        elif not req.specifier.contains(have.version, prereleases=True):
            where = "carried" if str(have._path).startswith(site) else "image"
            print(f"  unmet (imports all the same): {name} requires {r}, has {have.version} ({where})")

import numpy as np
import torch
from benchmarks.architecture import construct, served
from nemo_serve.engine.encoder import make_encoder
from nemo_serve.engine.slots import SlotPool
from nemo_serve.engine.step import StepBatch, run_step

t = time.time()
with torch.no_grad():
    construct("tiny-prompt")
    model = served("tiny-prompt", 3, "fp32", "cpu")
    enc = make_encoder(model)
    g = model.geometry
    pool = SlotPool(model, 2, enc.channel_shape)
    for i in range(2):
        pool.open_row(i)
    feats = torch.randn(2, model.num_mels, g.first_frames)
    run_step(model, enc, pool, StepBatch(np.arange(2), feats, [g.first_frames] * 2, True, None))
print(f"builtin:tiny-prompt built (construct/served, fp32, CPU) and stepped: ok ({time.time() - t:.1f} s)")
PYEOF
echo "[$(( $(date +%s) - T2 ))s] imports and tiny-prompt; total $(( $(date +%s) - T0 ))s"
