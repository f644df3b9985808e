#!/usr/bin/env bash
# Creates .venv with the pinned CPU environment and installs nemo-serve into it (editable).
# Torch first and alone: `torch==2.13.0` resolves to the CPU build that lies on local disk here;
# anything looser would pull a multi-GB CUDA build. On a CUDA machine use env/cuda.txt instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r env/cpu.lock.txt
.venv/bin/python -m pip install -q --no-deps -r env/nodeps.lock.txt  # why --no-deps: see the file
.venv/bin/python -m pip install -q --no-deps -e .
echo "nemo-serve environment ready in .venv"
