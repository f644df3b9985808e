"""Named ranges for one profiled step, and where the profile's time went per range.

`ranges(stepper)` wraps the stepper's, pool's, encoder's, layers' and decoder's methods on the
instances (module functions for the masks and the prompt) in torch.profiler.record_function
scopes for as long as it is entered, then puts them back: the engine itself carries no range, so
a step that is not profiled pays nothing. Rejected: record_function in engine/step.py and
encoder.py. With the profiler off one costs 17.3 us to enter and leave on this 2-core CPU (200,000
in a loop, best of 3; an empty loop turn 0.035 us), and a step would pass ~230 (9 per layer x 24,
and the step's own): ~4 ms per eager step here, measurable on any host. `analyse` attributes each
kernel to the innermost range around the op that launched it (a range's time excludes the ranges
nested in it: "decoder bookkeeping" is the decoder's own time outside the joint, the prediction
network and the state gather and scatter).
"""

from __future__ import annotations

from contextlib import contextmanager

RANGES = ("step other", "cache gather", "cache scatter", "pre-encode", "masks", "norms", "FFN", "attention",
          "conv module", "encoder other", "prompt", "joint", "prediction network", "decoder bookkeeping")  # fmt: skip
PREFIX = "ns:"


@contextmanager
def ranges(stepper):
    """A record_function range around each part, by wrapping instance methods (restored after)."""
    import torch

    import nemo_serve.engine.encoder as enc_mod
    import nemo_serve.engine.epilogues as epilogues_mod
    import nemo_serve.engine.step as step_mod

    patched = []

    def wrap(obj, attr, name):
        fn = getattr(obj, attr)

        def ranged(*a, **k):
            with torch.profiler.record_function(PREFIX + name):
                return fn(*a, **k)

        patched.append((obj, attr, obj.__dict__.get(attr, _MISSING) if hasattr(obj, "__dict__") else _MISSING))
        setattr(obj, attr, ranged)

    pool, enc, computer = stepper.pool, stepper.encoder, stepper._base()
    for attr in ("gather_encoder", "gather_history", "gather_decoder"):
        wrap(pool, attr, "cache gather")
    for attr in ("scatter_encoder", "scatter_history", "scatter_decoder"):
        wrap(pool, attr, "cache scatter")
    wrap(stepper, "run", "step other")
    wrap(stepper, "encode", "encoder other")
    wrap(stepper, "decode", "decoder bookkeeping")
    if hasattr(enc, "_pre_encode"):
        wrap(enc, "_pre_encode", "pre-encode")
        wrap(enc, "_attention", "attention")
    else:
        wrap(enc.encoder, "pre_encode", "pre-encode")
    wrap(enc_mod, "attention_masks", "masks")
    wrap(step_mod, "apply_prompt", "prompt")
    for layer in enc.encoder.layers:
        for n in ("norm_feed_forward1", "norm_self_att", "norm_conv", "norm_feed_forward2", "norm_out"):
            wrap(getattr(layer, n), "forward", "norms")
        wrap(layer.feed_forward1, "forward", "FFN")
        wrap(layer.feed_forward2, "forward", "FFN")
        wrap(layer.conv, "forward", "conv module")
        if not hasattr(enc, "_attention"):
            wrap(layer.self_attn, "forward", "attention")
    # The fused layer (NEMO_SERVE_KERNELS=fused, engine/epilogues.py) calls its conv module through
    # `conv_module`, not the module's forward, and each residual add + norm as one epilogue (one
    # Triton kernel on CUDA, where the norm modules are not called): both ranged here too.
    wrap(epilogues_mod, "conv_module", "conv module")
    if getattr(enc, "epilogues", None) is not None:
        wrap(enc.epilogues, "residual_norm", "norms")
    for attr in ("joint_after_projection", "project_encoder", "project_prednet"):
        wrap(computer.joint, attr, "joint")
    wrap(computer.decoder, "predict", "prediction network")
    try:
        yield
    finally:
        for obj, attr, old in reversed(patched):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


_MISSING = object()


def _owned(evt):
    """The ops under `evt` that belong to it, not to a nested range of ours."""
    for ch in evt.cpu_children:
        if ch.name.startswith(PREFIX):
            continue
        yield ch
        yield from _owned(ch)


def analyse(prof, cuda: bool) -> dict:
    """Per range (exclusive of nested ranges): calls, CPU ms, GPU ms and kernels; top kernels."""
    from torch.autograd import DeviceType

    per = {n: {"calls": 0, "cpu_ms": 0.0, "gpu_ms": 0.0 if cuda else None, "kernels": 0 if cuda else None} for n in RANGES}
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    for e in events:
        if not e.name.startswith(PREFIX) or e.name[len(PREFIX):] not in per:
            continue
        r = per[e.name[len(PREFIX):]]
        r["calls"] += 1
        nested = [c for c in _descendant_ranges(e)]
        r["cpu_ms"] += (e.cpu_time_total - sum(c.cpu_time_total for c in nested)) / 1000
        if cuda:
            ks = list(getattr(e, "kernels", [])) + [k for op in _owned(e) for k in getattr(op, "kernels", [])]
            r["gpu_ms"] += sum(k.duration for k in ks) / 1000
            r["kernels"] += len(ks)
    for r in per.values():
        r["cpu_ms"] = round(r["cpu_ms"], 3)
        if cuda:
            r["gpu_ms"] = round(r["gpu_ms"], 3)
    top_ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
    out = {"ranges": per, "cpu_ms_total": round(sum(r["cpu_ms"] for r in per.values()), 3),
           "top_ops": [{"name": a.key[:120], "calls": a.count, "self_cpu_ms": round(a.self_cpu_time_total / 1000, 3)}
                       for a in top_ops if not a.key.startswith(PREFIX)][:15],
           "gpu_ms_total": None, "kernels_total": None, "top_kernels": None, "index_kernels": None}  # fmt: skip
    if cuda:
        ks = [k for e in events for k in getattr(e, "kernels", [])]
        by: dict[str, list[float]] = {}
        for k in ks:
            by.setdefault(k.name, []).append(k.duration)
        top = sorted(by.items(), key=lambda kv: -sum(kv[1]))
        out["gpu_ms_total"] = round(sum(k.duration for k in ks) / 1000, 3)
        out["kernels_total"] = len(ks)
        out["top_kernels"] = [{"name": n[:160], "calls": len(d), "total_us": round(sum(d), 1),
                               "mean_us": round(sum(d) / len(d), 2)} for n, d in top[:25]]  # fmt: skip
        idx = [(n, d) for n, d in by.items() if "index" in n.lower() or "gather" in n.lower() or "scatter" in n.lower()]
        out["index_kernels"] = {"calls": sum(len(d) for _, d in idx), "total_us": round(sum(sum(d) for _, d in idx), 1),
                                "names": sorted(n[:120] for n, _ in idx)[:10]}  # fmt: skip
    return out


def _descendant_ranges(evt):
    """Our ranges nested directly under `evt` (not under another of ours)."""
    for ch in evt.cpu_children:
        if ch.name.startswith(PREFIX):
            yield ch
        else:
            yield from _descendant_ranges(ch)
