"""gpu_bench.py phase 3: the model built from configs/ (random init) and, per mode, a bias on its blank
logit calibrated until greedy decoding emits a trained model's tokens per encoder frame (gpu_bench.py's
docstring says why, and why max_symbols is capped)."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.gpu.emission import StepRecorder
from benchmarks.gpu.record import Results, free_gpu

def build(args, res: Results):
    from benchmarks.architecture import construct, served

    t = time.time()
    construct(args.model)
    models = {r: served(args.model, r, args.dtype, args.device) for r in args.modes}
    nemo = models[args.modes[0]].nemo
    computer = models[args.modes[0]].decoding_computer  # the modes share the NeMo model, hence its decoder
    max_symbols_trained = int(computer.max_symbols)
    computer.max_symbols = args.max_symbols  # before any stepper exists: steppers size their outputs by it
    res.write("model", model=args.model, dtype=args.dtype, device=args.device, build_s=round(time.time() - t, 1),
              parameters=sum(p.numel() for p in nemo.parameters()), max_symbols=args.max_symbols,
              max_symbols_configured=max_symbols_trained)  # fmt: skip
    return models


class EmissionProbe:
    """Tokens per decoded encoder frame, over `steps` later chunks of fixed noise features on `rows`
    fresh slots of one reused pool (freed and re-allocated per probe); `last`: the probe's spread
    and trip counts (emission.StepRecorder)."""

    def __init__(self, model, encoder, rows: int = 64, steps: int = 3, seed: int = 0) -> None:
        import torch

        from nemo_serve.engine.slots import SlotPool
        from nemo_serve.engine.step import Stepper

        self.model, self.rows, self.steps = model, rows, steps
        self.pool = SlotPool(model, rows, encoder.channel_shape)
        self.stepper = Stepper(model, encoder, self.pool, graphs=False)
        self.last: dict = {}
        g = model.geometry
        gen = torch.Generator().manual_seed(seed)
        self.first = torch.randn(rows, model.num_mels, g.first_frames, generator=gen).to(model.device)
        self.later = [torch.randn(rows, model.num_mels, g.chunk_frames, generator=gen).to(model.device)
                      for _ in range(steps)]  # fmt: skip

    def __call__(self) -> float:
        import torch

        from nemo_serve.engine.step import StepBatch

        g = self.model.geometry
        rows = np.arange(self.rows)
        for row in rows.tolist():
            self.pool.open_row(row)
        rec = StepRecorder(self.stepper)
        try:
            with torch.inference_mode():
                self.stepper.run(StepBatch(rows, self.first, [g.first_frames] * self.rows, True, None))
                for feats in self.later:
                    self.stepper.run(StepBatch(rows, feats, [g.chunk_frames] * self.rows, False, None))
        finally:
            rec.close()
        for row in rows.tolist():
            self.pool.close_row(row)
        self.last = rec.summary()
        return self.last["tokens_per_frame"]


def calibrate_blank(model, probe, target: float, tol: float, iters: int) -> dict:
    """Emission falls as the blank bias rises (steeply with random weights: 1.0 to 0.0 within
    ~0.2). Bracket the target by doubling steps out from 0, then bisect at least `iters` times,
    stopping early once within `tol`; the bias with the closest fraction is kept."""
    import torch

    out = model.nemo.joint.joint_net[-1]
    blank = model.blank_id
    base = out.bias[blank].item()
    seen: dict[float, float] = {}

    def frac(b: float) -> float:
        if b not in seen:
            with torch.no_grad():
                out.bias[blank] = base + b
            seen[b] = probe()
        return seen[b]

    lo, hi, step = 0.0, 0.0, 0.25  # lo: emits more than target; hi: emits less
    if frac(0.0) > target:
        hi = step
        while frac(hi) > target and hi < 1e4:
            lo, hi, step = hi, hi + 2 * step, 2 * step
    else:
        lo = -step
        while frac(lo) <= target and lo > -1e4:
            hi, lo, step = lo, lo - 2 * step, 2 * step
    bracket = (lo, hi)
    for _ in range(iters):
        mid = (lo + hi) / 2
        if frac(mid) > target:
            lo = mid
        else:
            hi = mid
        if abs(seen[mid] - target) <= tol:
            break
    best = min(seen, key=lambda b: abs(seen[b] - target))
    frac(best)  # leaves the bias at best
    with torch.no_grad():
        out.bias[blank] = base + best
    return {"blank_bias_added": best, "measured": seen[best], "target": target, "tolerance": tol,
            "within_tolerance": abs(seen[best] - target) <= tol, "bracket": list(bracket),
            "probes": len(seen)}  # fmt: skip


def calibrate(args, models, res: Results) -> dict[int, float]:
    """Each mode its own blank bias (the joint is shared by the modes' models; one bias would emit on
    29% of the frames at 80 ms and 71% at 1120 ms when it gives 34% at 320 ms: measured on the H200),
    so every mode's decoder does comparable work. Returns the bias per mode (`set_blank_bias`)."""
    from benchmarks.architecture import set_mode
    from nemo_serve.engine.encoder import make_encoder

    base = _blank_bias(models[args.modes[0]])
    biases = {}
    for r, m in models.items():
        t = time.time()
        set_mode(m)
        set_blank_bias(m, base)
        probe = EmissionProbe(m, make_encoder(m))
        cal = calibrate_blank(m, probe, args.tokens_target, args.tokens_tol, args.calibrate_iters)
        probe()  # at the kept bias: its spread and trips for the record
        cal["load"] = probe.last
        del probe
        biases[r] = base + cal["blank_bias_added"]
        res.write("calibration", chunk_ms=round(m.geometry.chunk_ms), context_right=r, seconds=round(time.time() - t, 1),
                  **cal)  # fmt: skip
        free_gpu()
    return biases


def _blank_bias(model) -> float:
    return model.nemo.joint.joint_net[-1].bias[model.blank_id].item()


def set_blank_bias(model, value: float) -> None:
    """In place: captured graphs read the parameter's memory, so they see it at their next replay."""
    import torch

    with torch.no_grad():
        model.nemo.joint.joint_net[-1].bias[model.blank_id] = value

