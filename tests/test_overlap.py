"""Launch, then collect (engine/loop.py, engine/step.py): host and device work overlap.

On a CPU the device work is done when `launch` returns, so nothing overlaps by itself. The stand-in
device here runs each step's real work (`Stepper.launch` + `collect`: staging, encoder, decoder)
on one worker thread, in launch order like a device stream, and takes at least `device_s` per
step; `collect` waits for it. A stand-in host adds `host_s` to each group's feature computation.
Then (a) the overlapped loop gives every stream the same updates (tokens, frames, finals,
segments, audio processed) and the same slot accounting as the sequential loop, over streams
that arrive at different times, with an abort while a step is in flight; (b) a step costs about
max(host, device) of wall time overlapped, and their sum sequentially.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from nemo_serve.engine.endpoint import EndpointConfig
from nemo_serve.engine.staging import LaunchedStep
from nemo_serve.engine.step import stepper_for

from . import helpers


class ThreadDevice:
    """A stepper whose steps run asynchronously on one worker thread (in order, as on a device
    stream), each taking at least `device_s`. Everything else is the real stepper's."""

    def __init__(self, stepper, device_s: float) -> None:
        self.stepper, self.device_s = stepper, device_s
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="stand-in-device")
        self.busy_s = 0.0  # time the device was busy

    def __getattr__(self, name):
        return getattr(self.stepper, name)

    def launch(self, batch) -> LaunchedStep:
        # The real launch's host half first: rows freed since the last step are reset before the
        # step is enqueued (its gather reads them), in order with the steps already enqueued.
        self.stepper.pool.flush()
        return LaunchedStep(self, [self.worker.submit(self._run, batch)], batch.confidence)

    def _run(self, batch):
        start = time.perf_counter()
        with torch.inference_mode():
            result = self.stepper.run(batch)
        time.sleep(max(0.0, self.device_s - (time.perf_counter() - start)))
        self.busy_s += time.perf_counter() - start
        return result

    def collect(self, step: LaunchedStep):
        return step.parts[0].result()


class SlowFeatures:
    """The engine's feature extractor, plus `host_s` of host work per group."""

    def __init__(self, features, host_s: float) -> None:
        self.features, self.host_s = features, host_s

    def __getattr__(self, name):
        return getattr(self.features, name)

    def compute_group(self, *args, **kw):
        time.sleep(self.host_s)
        return self.features.compute_group(*args, **kw)


def _engine(m, num_slots: int, overlap: bool, device_s: float | None, host_s: float = 0.0):
    endpoint = EndpointConfig(enabled=True, rule2_min_trailing_silence_s=0.4).validated()
    engine = helpers.bare_engine(m, num_slots, endpoint, overlap=overlap)
    if device_s is not None:
        engine.pool.steppers[engine.geometry.context_right] = ThreadDevice(stepper_for(m, engine.encoder, engine.pool), device_s)
    if host_s:
        engine.features = SlowFeatures(engine.features, host_s)
    return engine


def _drive(engine, audios, start_tick, packets, abort_at=None, final_at=None, max_ticks=5000):
    """As the engine core drives it: streams admitted on their slots at their ticks, one packet
    each per tick (then end of input), one iterate() per tick. `abort_at`: stream -> tick from
    which it is aborted at the first tick its slot has a step in flight; `final_at`: the same for
    a forced final. Returns (updates by
    stream with the arrival time left out, release order, steps)."""
    abort_at, final_at = abort_at or {}, final_at or {}
    n = len(audios)
    streams, pos, released, steps, aborted, forced = {}, [0] * n, [], 0, set(), set()
    updates = {i: [] for i in range(n)}
    for tick in range(max_ticks):
        for i in range(n):
            if tick == start_tick[i]:
                streams[i] = engine.admit(slot=i, stream_id=f"s{i}")
            s = streams.get(i)
            if s is None or f"s{i}" in released:
                continue
            if i not in aborted and tick >= abort_at.get(i, max_ticks) and engine.in_flight.flying[s.slot]:
                free = engine.num_free_slots
                engine.abort(s, "test")
                aborted.add(i)
                engine.check_accounting()  # between calls: the in-flight books agree
                # Its step owns the cache row until collected: the slot is not given back before.
                assert engine.slots.holds(s) and engine.num_free_slots == free, "released while in flight"
            if i not in forced and tick >= final_at.get(i, max_ticks) and engine.in_flight.flying[s.slot]:
                engine.force_final(s)
                forced.add(i)
            if pos[i] < len(audios[i]):
                piece = audios[i][pos[i] : pos[i] + packets[i]]
                pos[i] += len(piece)
                engine.take_audio(s, (piece,), time.time())
                if pos[i] >= len(audios[i]):
                    engine.finish(s)
        out = engine.iterate()
        steps += len(out.steps)
        for u in out.updates:
            assert u.stream_id not in released, f"an update for {u.stream_id} after its release"
            i = int(u.stream_id[1:])
            updates[i].append((u.segment, u.is_final, u.done, u.new_token_ids, u.new_token_frames,
                               u.segment_start_frame, round(u.audio_processed_s, 6)))  # fmt: skip
        released += [r.stream_id for r in out.released]
        assert engine.check_accounting() == engine.num_open_streams
        if len(released) == n and not out.in_flight:
            break
    assert sorted(released) == sorted(f"s{i}" for i in range(n)), released
    assert engine.num_free_slots == engine.num_slots and engine.check_accounting() == 0
    assert engine.in_flight.idle()
    return updates, released, steps


def test_overlapped_loop_gives_the_sequential_loops_results():
    """Many streams, arriving at different ticks in different packet sizes, one aborted while
    its step is in flight: every other stream's updates equal the sequential loop's, update for
    update; the aborted one gets nothing after its abort and its slot comes back once."""
    m = helpers.model(None, 0)
    n = 10
    audios = [a[: 16000 * 3] for a in helpers.utterances(n, seed=7)]
    start_tick = [(3 * i) % 7 for i in range(n)]
    packets = [800 + 400 * (i % 4) for i in range(n)]
    seq, seq_released, seq_steps = _drive(_engine(m, n, overlap=False, device_s=None), audios, start_tick, packets)
    ovl, ovl_released, ovl_steps = _drive(_engine(m, n, overlap=True, device_s=0.002), audios, start_tick, packets,
                                          abort_at={9: 12})  # fmt: skip
    for i in range(n - 1):
        assert ovl[i] == seq[i], f"stream {i}: overlapped {ovl[i]} != sequential {seq[i]}"
    assert ovl[9] and not any(u[2] for u in ovl[9]), "the aborted stream got no update before, or a done final"
    assert ovl[9] == seq[9][: len(ovl[9])] and len(ovl[9]) < len(seq[9])
    assert sorted(ovl_released) == sorted(seq_released)
    assert sum(1 for u in (x for i in range(n - 1) for x in seq[i]) if u[1]) > n - 1  # endpoints fired too


def test_a_step_costs_the_larger_of_host_and_device_time_not_their_sum():
    """Two cohorts of streams with all their audio there: the loop always has one step to launch
    while the other runs. Each step's host work (`host_s`) and device work (`device_s`) are
    known; per step the overlapped loop takes about the larger, the sequential loop the sum."""
    m = helpers.model(None, 0)
    host_s = device_s = 0.08
    n = 8
    audios = [a[: 16000 * 2] for a in helpers.utterances(n, seed=3)]
    start_tick = [0] * (n // 2) + [1] * (n // 2)  # two cohorts: they alternate once overlapped
    packets = [len(a) for a in audios]
    per_step = {}
    for overlap in (False, True):
        engine = _engine(m, n, overlap=overlap, device_s=device_s, host_s=host_s)
        t0 = time.perf_counter()
        _, _, steps = _drive(engine, audios, start_tick, packets)
        per_step[overlap] = (time.perf_counter() - t0) / steps
    # Both carry the same real host work (features, planning, publishing: a few ms to tens on a
    # shared 2-core machine); overlapping hides min(host_s, device_s) of each step, not more.
    assert per_step[False] > 0.95 * (host_s + device_s), per_step
    assert per_step[False] - per_step[True] > 0.6 * min(host_s, device_s), per_step
    assert per_step[True] < 0.8 * (host_s + device_s), per_step
    print(f"wall per step: sequential {per_step[False] * 1e3:.1f} ms, overlapped {per_step[True] * 1e3:.1f} ms "
          f"(host {host_s * 1e3:.0f} ms, device {device_s * 1e3:.0f} ms)")  # fmt: skip


def test_a_forced_final_of_a_stream_in_flight_comes_after_its_steps_tokens():
    """force_final while the stream's step runs: the final closes the segment after that step's
    update, so no update of the next segment covers audio the closed one already counted, and
    the stream's tokens are the sequential loop's (a forced final changes no decoding)."""
    m = helpers.model(None, 0)
    audios = [a[: 16000 * 3] for a in helpers.utterances(2, seed=5)]
    seq, _, _ = _drive(_engine(m, 2, overlap=False, device_s=None), audios, [0, 1], [1600, 1600])
    ovl, _, _ = _drive(_engine(m, 2, overlap=True, device_s=0.002), audios, [0, 1], [1600, 1600], final_at={0: 10})
    finals = [u for u in ovl[0] if u[1] and not u[2]]  # endpoints' and the forced one
    assert len(finals) == len([u for u in seq[0] if u[1] and not u[2]]) + 1, ovl[0]
    for segment, *_, processed_s in finals:
        assert all(u[6] > processed_s for u in ovl[0] if u[0] > segment), (segment, ovl[0])
    assert [t for u in ovl[0] for t in u[3]] == [t for u in seq[0] for t in u[3]]
    assert ovl[1] == seq[1]
