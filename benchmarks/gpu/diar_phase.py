"""Streams per GPU with diarization on (issue 50 step 5): gpu_bench.py's last phase.

The engine core's loop as in gpu_bench's capacity phase (capacity_level: N real-time streams,
take_audio, iterate() on one thread), with a streaming Sortformer beside the ASR model (--diarizer,
default builtin:tiny-sortformer, at the server's latency setting, diarization/load.py) and every
stream asking for speakers ({"max_speakers": K}). The ASR path is the last --capacity-configs
entry (the candidate defaults), so each level sits beside that path's plain capacity in the same
run. A diarized update is held until its speakers are known (engine/speakers.py): by design it
waits up to the setting's latency (chunk + right context, 1.04 s at "low"), so the bound is two
ASR chunks plus that latency, and the record says so (`diar_wait_ms`). The diarizer's share of the
loop (its steps and seconds, diarization/runner.py) comes with each level.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.gpu.paths import applied


def diarization(args, model, res, levels: list[int]) -> None:
    from benchmarks.gpu.capacity import capacity_level, slots_that_fit
    from benchmarks.gpu.mode_checks import make_engine
    from benchmarks.gpu.record import free_gpu, left
    from nemo_serve.diarization.load import DEFAULT_SETTING, load_diarizer
    from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS

    g = model.geometry
    path = args.capacity_configs[-1]
    cap = slots_that_fit(model, args)
    if cap is not None and cap < max(levels):
        res.write("skipped", what=f"diarization {round(g.chunk_ms)} ms levels above {cap}", why="GPU memory")
        levels = [x for x in levels if x <= cap] or [cap]
    wait_s = MODEL_CARD_SETTINGS[DEFAULT_SETTING].latency_ms / 1000
    t = time.time()
    diarizer = load_diarizer(args.diarizer, device=model.device.type)
    with applied(path):
        engine, stepper = make_engine(model, max(levels), res, what="diar_engine", diarizer=diarizer)
    res.write("diarizer", name=args.diarizer, setting=DEFAULT_SETTING, wait_ms=round(1000 * wait_s),
              speakers=engine.diarizer.num_speakers, load_s=round(time.time() - t, 1),
              parameters=sum(p.numel() for p in diarizer.parameters()))  # fmt: skip
    try:
        audio = (0.05 * np.random.default_rng(0).standard_normal(g.sample_rate * 60)).astype(np.float32)
        admit = {"diarization": {"max_speakers": engine.diarizer.num_speakers}}
        for n in sorted(levels):
            if left(args.budget_s) < args.level_seconds + 10 + args.reserve_s:
                res.write("skipped", what=f"diarization {round(g.chunk_ms)} ms {n} streams", why="budget")
                break
            steps0, secs0 = engine.diarizer.num_steps, engine.diarizer.seconds
            out = capacity_level(args, model, engine, stepper, n, audio, args.level_seconds, admit=admit,
                                 extra_bound_s=wait_s)  # fmt: skip
            steps = engine.diarizer.num_steps - steps0
            res.write("diar_capacity", context_right=g.context_right, dtype=args.dtype, diarizer=args.diarizer,
                      setting=DEFAULT_SETTING, diar_wait_ms=round(1000 * wait_s), **path.fields,
                      diarizer_steps=steps, diarizer_ms_per_step=round(1000 * (engine.diarizer.seconds - secs0) / max(steps, 1), 2),
                      **out)  # fmt: skip
            if not out["keeps_up"] or out["open_after_drain"]:
                break
    finally:
        del engine, stepper, diarizer
        free_gpu()
