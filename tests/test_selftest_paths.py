"""The selftest says which path each part of the step took (layout, attention, epilogues, decoder,
joint) on one `paths:` line, and its tokens stay NeMo's with each choice."""

from __future__ import annotations

import io

import pytest

from nemo_serve.selftest import run_selftest

from . import helpers

ENV = ("NEMO_SERVE_KV_LAYOUT", "NEMO_SERVE_ATTENTION", "NEMO_SERVE_KERNELS", "NEMO_SERVE_DECODER",
       "NEMO_SERVE_LABEL_LOOP_ROWS", "NEMO_SERVE_JOINT")  # fmt: skip


@pytest.mark.parametrize("env, expected", [
    ({}, "paths: layout=ring attention=matmul epilogues=fused/torch decoder=label_loop/all joint=full"),
    ({"NEMO_SERVE_KV_LAYOUT": "window", "NEMO_SERVE_ATTENTION": "sdpa", "NEMO_SERVE_KERNELS": "nemo",
      "NEMO_SERVE_LABEL_LOOP_ROWS": "active", "NEMO_SERVE_JOINT": "argmax"},
     "paths: layout=window attention=sdpa epilogues=nemo decoder=label_loop/active joint=argmax"),
    ({"NEMO_SERVE_DECODER": "nemo"}, "paths: layout=ring attention=matmul epilogues=fused/torch decoder=nemo joint=full"),
])  # fmt: skip
def test_selftest_names_every_path_and_passes(env, expected, monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    code = run_selftest(2, context_right=helpers.model(None, None).trained_context_right[-1], num_slots=2, out=out)
    assert code == 0, out.getvalue()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("paths: ")]
    assert lines == [expected], lines
