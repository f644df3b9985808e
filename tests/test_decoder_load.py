"""The GPU bench's decoder load (benchmarks/gpu/emission.py): trip counts of NeMo's label loop
computed from tokens alone, checked against the loop itself on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu.emission import label_loop_trips, row_trips, spread, step_frame_counts  # noqa: E402

from . import helpers  # noqa: E402


def test_row_trips_by_hand():
    assert row_trips([0, 0, 0], 10) == [2]  # blank to the end: one outer, two inner
    assert row_trips([1, 0, 0], 10) == [0, 2]  # the label, then blanks from frame 0 again
    assert row_trips([0, 2, 0], 10) == [1, 0, 1]
    assert row_trips([2, 0], 2) == [0, 0, 0]  # max_symbols forces frame 1, found blank there
    assert row_trips([0, 1], 1) == [1]  # forced past the last frame: no outer iteration after it
    assert row_trips([2, 0, 1], 10) == [0, 0, 2, 0]
    assert label_loop_trips([[0, 0, 0], [2, 0, 1]], 10) == (4, 2 + 0 + 2 + 0)  # inner: max per outer


def _counting(computer):
    """Counts the joint and prediction-network calls of NeMo's loop (torch_impl on CPU)."""
    calls = {"joint": 0, "predict": 0}
    joint, decoder = computer.joint, computer.decoder
    jap, predict = joint.joint_after_projection, decoder.predict

    def j(*a, **k):
        calls["joint"] += 1
        return jap(*a, **k)

    def p(*a, **k):
        calls["predict"] += 1
        return predict(*a, **k)

    joint.joint_after_projection, decoder.predict = j, p
    return calls, lambda: (delattr(joint, "joint_after_projection"), delattr(decoder, "predict"))


def test_trip_counts_equal_nemo_loop_iterations(monkeypatch):
    """Per step, NeMo's loop calls the joint once per outer and once per inner iteration and the
    prediction network once per outer iteration: both equal label_loop_trips of the step's own
    tokens, over blank biases that give no emission, sparse emission and max_symbols per frame."""
    monkeypatch.setenv("NEMO_SERVE_DECODER", "nemo")  # the trips counted are NeMo's loop's (CUDA's default decoder)
    from nemo_serve.engine.slots import SlotPool
    from nemo_serve.engine.step import StepBatch, Stepper

    m = helpers.model("builtin:tiny-prompt", 13)
    enc = helpers.bare_engine(m, 6).encoder
    out = m.nemo.joint.joint_net[-1]
    base = out.bias[m.blank_id].item()
    calls, undo = _counting(m.decoding_computer)
    g = m.geometry
    gen = torch.Generator().manual_seed(5)
    seen = set()
    try:
        for bias in (-20.0, -3.0, 0.0, 0.3, 1.0, 50.0):
            with torch.no_grad():
                out.bias[m.blank_id] = base + bias
            pool = SlotPool(m, 6, enc.channel_shape)
            stepper = Stepper(m, enc, pool, graphs=False)
            rows = np.arange(5)
            for r in rows.tolist():
                pool.open_row(r)
            decoded = [0] * 5
            for k in range(3):
                w = g.first_frames if k == 0 else g.chunk_frames
                f = torch.randn(5, m.num_mels, w, generator=gen)
                calls.update(joint=0, predict=0)
                with torch.inference_mode():
                    r = stepper.run(StepBatch(rows, f, [w] * 5, k == 0, None))
                new = [d - p for d, p in zip(r.decoded_frames, decoded)]
                decoded = r.decoded_frames
                counts = step_frame_counts(r.token_frames, r.decoded_frames, new)
                outer, inner = label_loop_trips(counts, stepper.max_symbols)
                assert (calls["joint"], calls["predict"]) == (outer + inner, outer), (bias, k, counts)
                seen.add(max(max(c) for c in counts))
    finally:
        undo()
        with torch.no_grad():
            out.bias[m.blank_id] = base
    assert {0, m.decoding_computer.max_symbols} <= seen  # silent steps and forced advances both ran


def test_spread_counts_frames_by_tokens():
    s = spread([[0, 1, 2], [0, 0, 1]])
    assert s == {**s, "frames": 6, "tokens": 4, "emit_fraction": 0.5, "second_given_first": round(1 / 3, 4)}
    assert s["frames_by_tokens"] == {"0": 3, "1": 2, "2": 1}
