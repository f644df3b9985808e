"""The overload signal: how long ready audio waits for the step loop (engine/queue_delay.py), and the
admission that refuses new streams while it is too long (server/context.py, core/group.py).

The end-to-end refusal through a real multi-process server is in test_server_e2e.py."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from nemo_serve.engine.queue_delay import QueueDelay

from . import helpers


def test_windowed_maximum_matches_a_brute_force_scan():
    rng = random.Random(3)
    q = QueueDelay(window_s=2.0)
    history, now = [], 100.0
    for _ in range(2000):
        now += rng.choice([0.001, 0.01, 0.3, 0.9, 2.5])
        wait = rng.choice([0.0, rng.random(), 5 * rng.random(), 0.5])
        q.record(wait, now)
        history.append((now, wait))
        expected = max(w for t, w in history if t >= now - 2.0)
        assert q.value(now) == expected
        assert q.value(now + 1.9) == expected  # held until the window after the last step has passed
        assert q.value(now + 2.1) == 0.0  # an engine that has not stepped for a window is not behind


def test_a_step_longer_than_the_window_does_not_read_as_idle():
    q = QueueDelay(window_s=2.0)
    seen = []
    q.record(3.0, 100.0)
    seen.append(q.published)
    q.begin_step(101.0)  # a 10 s step starts
    seen.append(q.published)
    assert q.value(105.0) == 3.0 and q.value(110.9) == 3.0  # not 0 at 102 s: the engine is busy, not idle
    q.record(9.0, 111.0)
    seen.append(q.published)
    assert q.value(111.0) == 9.0 and q.value(113.1) == 0.0
    q.begin_step(120.0)  # idle for longer than the window before this step: nothing stands
    seen.append(q.published)
    assert q.value(121.0) == 0.0
    assert seen == [(3.0, 102.0), (3.0, math.inf), (9.0, 113.0), (0.0, math.inf)]


def _engine_after(audio: np.ndarray, age_s: float, context_right: int = 0, max_queue_delay_s: float = 0.0,
                  after_first_step=None):
    """The demo model at `context_right`, one stream given all of `audio` at once, stamped as having
    arrived `age_s` ago, stepped to its end. Returns the engine and the result latency of the last chunk."""
    engine = helpers.new_engine(helpers.model(None, context_right), 2, max_queue_delay_s=max_queue_delay_s)
    results = []
    stream = engine.open_stream(results.append)
    arrived = time.time() - age_s
    engine.push(stream, audio, arrived)
    engine.finish(stream)
    for i in range(10000):
        engine.iterate()
        if i == 0 and after_first_step is not None:
            after_first_step(engine)
        if results and results[-1].done:
            break
    assert results and results[-1].done
    lateness = time.time() - arrived
    helpers.assert_engine_empty(engine)
    return engine, lateness


def test_audio_that_waited_counts_and_a_fast_client_does_not():
    audio = np.concatenate(helpers.utterances(4, seed=2))  # ~12 s: ~150 chunks of 80 ms
    # Audio stamped 5 s ago was ready 5 s before the loop took it: that is what overload looks like.
    # Read after the first step: the delay is the largest of the last 2 s, and where the whole run
    # takes longer than that (a loaded machine) the first chunks' 5 s have left the window by the end.
    seen = []
    engine, _ = _engine_after(audio, 5.0, after_first_step=lambda e: seen.append(e.queue_delay_s))
    assert 5.0 <= seen[0] < 5.0 + 60, seen
    # The same audio sent at once, now: its last chunks come out long after their samples arrived
    # (that is the client's doing: each chunk waits for the one before it), yet no chunk waited for
    # the loop, so the engine is not behind.
    seen = []
    engine, lateness = _engine_after(audio, 0.0, after_first_step=lambda e: seen.append(e.queue_delay_s))
    assert engine.stats.stream_steps >= 100
    assert engine.queue_delay_s < lateness / 5, (engine.queue_delay_s, lateness)
    # The first chunk did wait for the first step (a few ms), so the delay was above 0 then; once
    # nothing has stepped for a whole window (2 s) it is 0 again.
    assert 0.0 < seen[0] < 1.0, seen
    expires = engine.engine.queue_delay.published[1]
    time.sleep(max(0.0, (expires if math.isfinite(expires) else 0.0) - time.time()) + 0.01)
    assert engine.queue_delay_s == 0.0


@pytest.mark.parametrize("step_sleep_s", [0.0, 0.16])
def test_real_time_stream_on_an_engine_that_keeps_up_or_runs_at_half_speed(monkeypatch, step_sleep_s):
    """A client at real-time pace, 80 ms chunks. Each iteration steps its one ready chunk, so no chunk
    is ever there before the previous step ends; with every step slowed by two chunks of audio the
    engine still falls behind by about half of the time that passes, and that is what must show."""
    from nemo_serve.engine import runner

    real_step = runner.launch_step

    def step(*args, **kw):
        time.sleep(step_sleep_s)
        return real_step(*args, **kw)

    monkeypatch.setattr(runner, "launch_step", step)
    engine = helpers.new_engine(helpers.model(None, 0), 2)
    audio = helpers.utterances(1, seed=4)[0]
    stream = engine.open_stream(lambda r: None)
    t0, pushed = time.time(), 0
    while time.time() - t0 < 2.4 and pushed < len(audio):
        arrived = min(len(audio), int((time.time() - t0) * 16000) // 1280 * 1280)  # whole 80 ms packets so far
        if arrived > pushed:
            engine.push(stream, audio[pushed:arrived])
            pushed = arrived
        engine.iterate()
    behind = time.time() - t0 - engine.stats.audio_s  # real time passed minus audio stepped
    if step_sleep_s:
        assert behind > 0.8 and engine.queue_delay_s > 0.6, (behind, engine.queue_delay_s)
    else:
        assert engine.queue_delay_s < 0.3, engine.queue_delay_s
    engine.abort(stream)
    helpers.assert_engine_empty(engine)


class _Core:
    """What EngineGroup reads of an EngineClient when it places a stream: free slots, the delay,
    and the core's own overload guard judging them."""

    def __init__(self, name: str, free: int, delay: float, limit: float = 2.0) -> None:
        from nemo_serve.admission import OverloadGuard

        self.name, self.num_free_slots, self.queue_delay_s, self.num_slots = name, free, delay, 4
        self.error, self.model_info = None, None
        self.guard = OverloadGuard(limit, self.num_slots)
        self.opened = 0

    @property
    def num_open_streams(self) -> int:
        return self.num_slots - self.num_free_slots

    def overload(self, decide: bool = False, now=None):
        now = time.time() if now is None else now  # as EngineClient: the moment the caller judges at
        return self.guard.judge(self.queue_delay_s, self.num_open_streams, now, decide)

    def open_stream(self, on_result, **kw):
        self.opened += 1
        self.num_free_slots -= 1
        return type("H", (), {})()


def _group(*cores):
    from nemo_serve.core.group import EngineGroup

    return EngineGroup(list(cores), [None] * len(cores))


def test_group_admits_on_a_core_whose_guard_admits():
    from nemo_serve.admission import Verdict

    behind, keeping_up = _Core("a", free=3, delay=4.0), _Core("b", free=2, delay=0.1)
    group = _group(behind, keeping_up)
    assert group.queue_delay_s == 0.1  # where a new stream would go
    assert group.overload(decide=True).refusal is None  # b admits: the group does
    assert behind.guard.cap == 1.0 and keeping_up.guard.cap is None  # a, asked first, refused: its cap is set
    group.open_stream(lambda r: None)
    assert (behind.opened, keeping_up.opened) == (0, 1)  # fewer free slots, but its guard admits
    keeping_up.num_free_slots = 0  # full: the core that is behind is all that is left
    assert group.queue_delay_s == 4.0
    verdict = group.overload()
    assert "4.00 s behind" in verdict.refusal and verdict.behind and verdict.cap == 1 + 4  # b counts its slots
    group.open_stream(lambda r: None)  # a stream no guard judges (a realtime session's next item)
    assert behind.opened == 1
    # Off (0): free slots alone decide.
    behind2, other = _Core("a", free=3, delay=40.0, limit=0.0), _Core("b", free=1, delay=0.0, limit=0.0)
    assert _group(behind2, other).overload(decide=True) == Verdict(None, False, None)
    _group(behind2, other).open_stream(lambda r: None)
    assert (behind2.opened, other.opened) == (1, 0)


def test_group_judges_every_core_at_the_moment_it_is_given():
    """/readyz passes one `now` for the verdict and every core's cap (a recovering cap grows with
    time): the group hands it on to each core."""
    core = _Core("a", free=3, delay=4.0)
    group = _group(core)
    t0 = time.time()
    assert group.overload(decide=True, now=t0).refusal is not None  # behind: refused, its cap set to 1
    core.queue_delay_s = 0.0
    assert group.overload(now=t0).cap == 1
    assert group.overload(now=t0 + 10).cap is None  # 10 s of growth at 1 stream a second: past its 4 slots


def test_group_refuses_only_when_no_core_with_room_admits():
    """Each core's guard judges its own numbers; a decision asks the cores with room, most free
    slots first, and stops at the first that admits: the cores after it are only read."""
    from nemo_serve.admission import GuardState

    capped, full = _Core("a", free=3, delay=0.0), _Core("b", free=0, delay=0.0)
    capped.guard.store.save_guard(GuardState(cap=1.0, last=time.time()))  # recovering, with 1 open
    refusal = _group(capped, full).overload(decide=True).refusal
    assert "admitting up to 1 open streams for now (1 open)" in refusal
    assert full.guard.store.load_guard() == GuardState()  # no slot to give: not asked
    roomy, before = _Core("c", free=3, delay=0.0), capped.guard.store.load_guard()
    verdict = _group(roomy, capped).overload(decide=True)  # c first in line (ties: the first core)
    assert verdict.refusal is None and roomy.guard.store.load_guard().last is not None
    assert capped.guard.store.load_guard() == before  # after a core admitted: only read
    assert verdict.cap == 4 + 1 and not verdict.behind  # c counts its slots, a its cap


def test_group_tries_the_next_core_when_another_front_end_took_the_last_slot():
    """Free counts are read before the slot is taken, and another front end process can take that
    core's last slot in between: the stream goes to the next core with room, not refused (seen:
    the fourth of four streams refused with two front ends on two 2-slot cores)."""
    from nemo_serve.engine.errors import NoFreeSlotError

    class Raced(_Core):
        def open_stream(self, on_result, **kw):
            self.num_free_slots = 0  # taken by the other front end after the group read 2
            raise NoFreeSlotError("all 2 slots are in use")

    raced, other = Raced("a", free=2, delay=0.0), _Core("b", free=1, delay=0.0)
    group = _group(raced, other)
    group.open_stream(lambda r: None)
    assert other.opened == 1
    with pytest.raises(NoFreeSlotError):  # and when every core is full, the group refuses
        _group(Raced("a", free=2, delay=0.0), _Core("b", free=0, delay=0.0)).open_stream(lambda r: None)


@pytest.mark.parametrize("limit, refused", [(2.0, True), (0.0, False), (10.0, False)])
def test_admission_refuses_while_the_engine_is_behind(limit, refused):
    """The server's admission (ServerContext.refusal, used at the handshake and when the slot is
    taken) on a real in-process engine whose last step ran audio that had waited 5 s."""
    from nemo_serve.config import Settings
    from nemo_serve.server.context import ServerContext
    from nemo_serve.server.metrics import ServerMetrics

    engine, _ = _engine_after(helpers.utterances(1, seed=1)[0], 5.0, context_right=13, max_queue_delay_s=limit)
    settings = Settings.from_sources({"max_queue_delay_s": limit}, {})
    metrics = ServerMetrics(engine.num_slots, lambda: engine.num_free_slots, queue_delay_fn=lambda: engine.queue_delay_s)
    ctx = ServerContext(engine=engine, settings=settings, metrics=metrics)
    assert ctx.overloaded is refused
    refusal = ctx.refusal()
    if refused:
        assert refusal[0] == "overloaded" and "overloaded" in refusal[1] and "limit 2 s" in refusal[1], refusal
    else:
        assert refusal is None
    gauge = [line for line in metrics.render().decode().splitlines() if line.startswith("nemo_serve_queue_delay_seconds ")]
    assert len(gauge) == 1 and 5.0 <= float(gauge[0].split()[1]) < 65.0


def test_overload_guard_halves_on_overload_and_readmits_gradually():
    """The waves of benchmarks/results/overload_demo_r13_cpu.json: refused while behind, then every
    waiting client admitted at once. The guard instead re-admits up to half of what was open when
    the delay crossed the limit, and raises that cap only while the delay stays under half the limit."""
    from nemo_serve.admission import OverloadGuard

    g = OverloadGuard(limit_s=2.0, num_slots=400)
    assert g.decide(0.5, 300, now=0.0) is None  # under the limit: the slots alone decide
    assert "2.50 s behind" in g.decide(2.5, 240, now=1.0)  # crossed with 240 open
    assert g.decide(5.0, 100, now=5.0) is not None  # still behind: the cap stays 120, not 50
    assert g.cap == 120
    assert "up to 120" in g.decide(1.5, 130, now=20.0)  # back under the limit, 130 still open
    assert g.decide(1.5, 119, now=30.0) is None and g.cap == 120  # no growth while over half the limit
    assert g.decide(0.5, 126, now=31.0) is not None and g.cap == 126  # 5% of 120 in the 1 s since
    assert g.decide(0.5, 125, now=31.0) is None
    # Healthy long enough and the cap reaches the slots: dropped.
    assert g.decide(0.1, 399, now=200.0) is None and g.cap is None
    # A small cap grows by at least one stream a second; crossing again halves what is open then.
    assert g.decide(3.0, 2, now=300.0) is not None and g.cap == 1.0
    assert g.decide(0.0, 1, now=300.5) is not None and g.cap == 1.5  # room for int(1.5) = 1 stream
    assert g.decide(0.0, 1, now=301.5) is None and g.cap == 2.5
    assert OverloadGuard(limit_s=0.0, num_slots=4).decide(100.0, 4, now=0.0) is None  # off
