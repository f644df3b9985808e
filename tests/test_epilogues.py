"""engine/epilogues.py: the fused layer against NeMo's layer on the demo model's weights.

- The torch twins (the CPU's fused path) are NeMo's ops in NeMo's order: the fused layer equals
  `KVCacheEncoder._nemo_layer` (NeMo's layer, token-identical to NeMo's loop by the parity tests)
  bit for bit, fp32 and bf16.
- The Triton kernels (CUDA's fused path), run on the CPU in Triton's interpreter: each epilogue
  against its twin, and the whole layer against NeMo's, within stated tolerances. Tolerances: fp32
  max abs difference 1e-4 on a layer output of unit scale (a LayerNorm's sums in another order: a
  few 1e-7 per epilogue, grown through one layer's GEMMs); bf16 4 units in the last place at the
  values' scale (2^-6 relative: one rounding of r in another order, then the norm's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_serve.engine.encoder import KVCacheEncoder
from nemo_serve.engine.epilogues import TorchEpilogues, conv_fusable, fused_layer, kernels_kind

from . import helpers
from .helpers_epilogues import _layer_inputs, _attend

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_twins_are_nemos_layer_bitwise(dtype):
    model = helpers.model(None, None, dtype)
    layer, x, cache, pad_mask = _layer_inputs(model)
    assert conv_fusable(layer.conv) is None, "the demo model's conv module should take the fused path"
    with torch.inference_mode():
        ref, ref_cache = KVCacheEncoder._nemo_layer(layer, x, _attend, pad_mask, cache)
        out, out_cache = fused_layer(TorchEpilogues(), layer, x, _attend, pad_mask, cache)
    assert torch.equal(out, ref) and torch.equal(out_cache, ref_cache)


@pytest.fixture(scope="module")
def interpreter_run():
    """tests/epilogue_triton_checks.py in a child process: Triton reads TRITON_INTERPRET when it is
    imported, and NeMo imports it (optional_libs) before any test could set it here. One child for
    both dtypes: its imports (about 9 s) are most of its time."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "tests.epilogue_triton_checks", "fp32", "bf16"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_kernels_in_the_interpreter(interpreter_run, dtype):
    run = interpreter_run  # its checks print a line each as they pass, and stop at the first failure
    passed = run.stdout.split()
    assert f"{dtype}-layer-ok" in passed and f"{dtype}-epilogues-ok" in passed, run.stdout[-3000:] + run.stderr[-3000:]


def test_kernels_kind_defaults_and_refusal(monkeypatch):
    monkeypatch.delenv("NEMO_SERVE_KERNELS", raising=False)
    assert kernels_kind(torch.device("cpu")) == "fused"
    assert kernels_kind(torch.device("cuda")) == "nemo"  # until a GPU run checks the Triton kernels
    monkeypatch.setenv("NEMO_SERVE_KERNELS", "nemo")
    assert kernels_kind(torch.device("cpu")) == "nemo"
    monkeypatch.setenv("NEMO_SERVE_KERNELS", "fast")
    with pytest.raises(ValueError, match="NEMO_SERVE_KERNELS"):
        kernels_kind(torch.device("cpu"))
