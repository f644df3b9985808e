"""Admission under overload (admission.py): the guard's state moves only when a stream is
admitted or refused, and /readyz, which only reads it, agrees with what the next stream is told.
One guard per engine core, its state in the core's shared block: every front end judges by it.

The end-to-end tests drive a real server whose overload limit is 1 us, so that any stepped chunk
puts it over (real overload takes more streams than CI can afford; benchmarks/overload.py)."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest

from nemo_serve.client import ServerRefused, StreamingClient
from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots
from nemo_serve.admission import GuardState, OverloadGuard

from . import helpers
from .helpers_server import TOKEN, encode, start_server

NUM_SLOTS = 64
EPISODE_STREAMS = 8  # open when the delay crosses the limit: the cap is half of them
BURST = 12


def test_verdict_reads_and_decide_moves_the_guard():
    g = OverloadGuard(limit_s=2.0, num_slots=400)
    for now in (1.0, 2.0, 3.0):  # read while behind: nothing is stored
        v = g.verdict(2.5, 240, now)
        assert v.behind and v.cap == 120 and "2.50 s behind" in v.refusal
    assert g.cap is None and g.verdict(0.0, 300, now=4.0).refusal is None and not g.verdict(0.0, 0, 4.0).overloaded
    assert "2.50 s behind" in g.decide(2.5, 240, now=5.0) and g.cap == 120  # a refusal sets the cap
    v = g.verdict(0.0, 119, now=10.0)  # five healthy seconds since that decision: 120 + 5 x 6
    assert (v.refusal, v.cap, v.behind, v.overloaded) == (None, 150, False, True)
    for now in (10.0, 11.0, 12.0):  # a verdict and the decision that follows it agree
        for open_streams in (149, 150 + int(now) - 10):
            assert g.verdict(0.0, open_streams, now).refusal == g.decide(0.0, open_streams, now)
    assert g.cap > 150 and g.verdict(0.0, 0, now=12.0).cap == int(g.cap)


def test_two_guards_over_one_shared_state_agree(tmp_path):
    """Two front ends' guards on one engine core: each with its own view of the core's shared block
    and its own handle on the core's lock, as two processes have. A decision by one is what the
    other reads and decides from (a guard per front end would not know the cap was set)."""
    layout = SharedLayout(num_slots=8, ring_samples=16)
    creator = SharedSlots.create(layout, FileLock(str(tmp_path / "slots.lock")))
    attached = SharedSlots.attach(creator.name, layout, FileLock(str(tmp_path / "slots.lock")))
    try:
        a = OverloadGuard(2.0, 8, store=creator, lock=creator.lock)
        b = OverloadGuard(2.0, 8, store=attached, lock=attached.lock)
        assert a.verdict(2.5, 6, now=1.0).cap == 3 and b.cap is None  # a reading stores nothing
        assert "2.50 s behind" in a.decide(2.5, 6, now=1.0)  # refused: the cap is half of the 6 open
        assert b.cap == 3.0 and attached.load_guard() == GuardState(3.0, True, 1.0)
        assert "2.00 s behind" in b.decide(2.0001, 2, now=2.0) and a.cap == 3.0  # still over: the cap stays
        va, vb = a.verdict(0.0, 4, now=4.0), b.verdict(0.0, 4, now=4.0)  # 2 s healthy since b's decision
        assert va == vb and (va.refusal, va.cap) == (None, 5)
        assert a.decide(0.0, 4, now=4.0) is None
        assert "admitting up to 5 open streams for now (5 open)" in b.decide(0.0, 5, now=4.0)
        assert b.decide(0.0, 7, now=10.0) is None and a.cap is None  # grown to the slots: dropped for both
    finally:
        attached.close()
        creator.close()


def test_two_front_ends_clients_judge_the_cores_numbers_by_one_guard(tmp_path):
    """Through EngineClient, the front end's handle on a core: the open streams judged are every
    front end's, the delay the core's, the guard one; each front end refuses with the same cap."""
    from nemo_serve.core.client import EngineClient
    from nemo_serve.engine.geometry import ChunkGeometry, ModelInfo

    g = ChunkGeometry(context_left=56, context_right=3, first_frames=25, chunk_frames=32, pre_cache_frames=9,
                      drop_frames=2, min_first_frames=1, min_later_frames=8, hop_samples=160, sample_rate=16000,
                      subsampling=8)  # fmt: skip
    info = ModelInfo(name="m", geometry=g, vocabulary=[], is_bpe=True, prompt_dictionary=None,
                     default_language=None, feature_margin=240, summary="")  # fmt: skip
    layout = SharedLayout(num_slots=8, ring_samples=16)
    core = SharedSlots.create(layout, FileLock(str(tmp_path / "slots.lock")))
    views = [SharedSlots.attach(core.name, layout, FileLock(str(tmp_path / "slots.lock"))) for _ in range(2)]
    try:
        fe0, fe1 = (EngineClient(info, v, i, str(tmp_path), max_queue_delay_s=2.0) for i, v in enumerate(views))
        held = [core.allocate(frontend=0)[0] for _ in range(4)] + [core.allocate(frontend=1)[0] for _ in range(2)]
        core.queue_delay[:] = (3.0, time.time() + 60)  # the core is 3 s behind
        assert fe0.overload().refusal is not None and fe1.overload().cap == 3  # readings: nothing stored
        assert core.load_guard() == GuardState()
        assert "3.00 s behind" in fe1.overload(decide=True).refusal  # 6 open on the core: the cap is 3
        core.queue_delay[:] = (0.0, 0.0)  # caught up
        core.free(held[:3])  # 3 open: one front end's 1, the other's 2
        for fe in (fe0, fe1):
            v = fe.overload(decide=True)
            assert "admitting up to 3 open streams for now (3 open)" in v.refusal and v.cap == 3
        core.free(held[3:4])
        assert fe0.overload(decide=True).refusal is None and fe1.overload().refusal is None
    finally:
        for v in views:
            v.close()
        core.close()


def _audio(seconds: float) -> np.ndarray:
    utt = helpers.utterances(1, seed=3)[0]
    return encode(np.resize(utt, int(seconds * 16000)), "pcm_s16le")


async def _readyz(srv):
    r = await asyncio.to_thread(srv.get, "/readyz")
    return r.status_code, r.json()


async def _open(srv) -> StreamingClient | ServerRefused:
    c = StreamingClient(srv.ws_url, sample_rate=16000, encoding="pcm_s16le", token=TOKEN)
    try:
        return await c.__aenter__()
    except ServerRefused as e:
        return e


async def _close(clients) -> None:
    for c in clients:
        await c.end()
    for c in clients:
        async for _ in c.messages():
            pass
        await c.__aexit__(None, None, None)


async def _until(srv, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        _, body = await _readyz(srv)
        if predicate(body):
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.05)


async def _real_time_streams(srv, until: asyncio.Event) -> tuple[list, list]:
    """EPISODE_STREAMS streams opened, each sending audio at real-time pace (its task) until `until`
    is set: an episode's checks of a server that is behind must not outlast the audio that keeps it
    behind (a loaded CI run read 200 after the streams ended), and need no more of it (a fixed 3 s
    each cost CI seconds the checks did not use)."""
    clients = [await _open(srv) for _ in range(EPISODE_STREAMS)]
    assert all(isinstance(c, StreamingClient) for c in clients), clients
    wire = _audio(3.0)

    async def send(c: StreamingClient) -> None:
        t0, sent = time.monotonic(), 0
        while not until.is_set():
            i = sent % len(wire)
            await c.send_audio(wire[i : i + 1600])
            sent += len(wire[i : i + 1600])
            await asyncio.sleep(max(0.0, t0 + sent / 16000 - time.monotonic()))

    return clients, [asyncio.create_task(send(c)) for c in clients]


async def _overload_episode(srv, refuse_one: bool) -> None:
    """EPISODE_STREAMS real-time streams until the engine is behind, /readyz polled all along;
    with `refuse_one` a stream arrives then (and is refused); then every stream ends and the server
    goes idle (the delay window passes)."""
    checked = asyncio.Event()
    clients, senders = await _real_time_streams(srv, until=checked)
    await _until(srv, lambda b: b["overloaded"])
    for _ in range(5):  # a load balancer's health check
        status, body = await _readyz(srv)
        assert status == 503 and body["queue_delay_s"] > 0, body
    if refuse_one:
        refused = await _open(srv)
        assert isinstance(refused, ServerRefused) and "behind real time" in str(refused), refused
    checked.set()
    await asyncio.gather(*senders)
    await _close(clients)
    await _until(srv, lambda b: b["open_streams"] == 0 and b["ready"])  # the delay window has passed


def test_readyz_agrees_with_admission_after_an_overload():
    with start_server("--num-slots", str(NUM_SLOTS), "--frontends", "1", "--max-queue-delay-s", "0.000001") as srv:

        async def only_polled():
            """No stream arrived while the engine was behind, only health checks: the guard learned
            nothing, and a burst to the idle server is admitted in full, as /readyz said."""
            await _overload_episode(srv, refuse_one=False)
            status, idle = await _readyz(srv)
            burst = await asyncio.gather(*(_open(srv) for _ in range(BURST)))
            admitted = [c for c in burst if isinstance(c, StreamingClient)]
            await _close(admitted)
            return status, idle, [str(c) for c in burst if isinstance(c, ServerRefused)]

        status, idle, refused = asyncio.run(only_polled())
        assert status == 200 and idle["ready"], idle
        assert refused == [], (idle, refused)
        assert idle["recovering_cap"] is None and not idle["overloaded"], idle

        async def refused_while_behind():
            """A stream refused while behind sets the cap; /readyz shows it and, stream by stream,
            says 503 exactly when the next one is refused."""
            await _until(srv, lambda b: b["open_streams"] == 0 and b["ready"])  # the delay window has passed
            await _overload_episode(srv, refuse_one=True)
            held, seen = [], []
            while True:
                status, body = await _readyz(srv)
                outcome = await _open(srv)
                seen.append((status, body["recovering_cap"], body["open_streams"], outcome))
                if isinstance(outcome, ServerRefused):
                    break
                held.append(outcome)
                assert len(held) < NUM_SLOTS
            after = await _readyz(srv)
            await _close(held)
            return seen, after

        seen, (after_status, after) = asyncio.run(refused_while_behind())
        assert seen[0][0] == 200 and seen[0][1] >= EPISODE_STREAMS // 2, seen  # the cap: half of those open then
        for i, (status, cap, open_streams, outcome) in enumerate(seen):
            assert cap is not None and (status == 200) == (open_streams < cap), seen
            if status == 200:
                assert isinstance(outcome, StreamingClient), seen
            elif isinstance(outcome, StreamingClient):  # the cap grew (a stream a second) since the read
                assert seen[i + 1][1] > cap, seen
            else:
                said = int(re.search(r"admitting up to (\d+) open streams", str(outcome)).group(1))
                assert said >= cap, seen
        assert after["overloaded"] and after["recovering_cap"] is not None, after
        assert (after_status == 503) == (after["open_streams"] >= after["recovering_cap"]), after
        srv.assert_no_leak()


def _core_caps(body: dict) -> list[int | None]:
    return [c["recovering_cap"] for c in body["cores"]]


def test_front_ends_share_each_cores_guard():
    """With two front ends, each engine core's guard is one, in its shared block: one stream refused
    while the cores are behind sets every core's cap; afterwards each /readyz, whichever front end
    answers, shows those caps (growing from that decision at the same pace), says 503 exactly when
    the next stream is refused, and streams taken through both front ends stop at each core's cap.
    (A guard per front end fails this: the front end that did not judge the refused stream has no
    cap, says ready and admits up to the slots.) Two front ends over two cores: both front ends
    read and move each core's guard, as two over one core do its one, and the group's cap is the
    sum besides (the one-core server was dropped from CI's time: it covers nothing more)."""
    server_args = ("--devices", "cpu,cpu", "--frontends", "2")
    from .helpers_processes import frontend_pids, streams_per_frontend

    with start_server("--num-slots", str(NUM_SLOTS), "--max-queue-delay-s", "0.000001", "--idle-timeout-s", "120",
                      *server_args) as srv:  # fmt: skip
        deadline = time.monotonic() + 60
        while len(frontend_pids(srv)) < 2:  # /readyz answers as soon as the first one listens
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.2)

        async def scenario():
            refusal_made = asyncio.Event()
            clients, senders = await _real_time_streams(srv, until=refusal_made)
            await _until(srv, lambda b: all(c["queue_delay_s"] > 0 for c in b["cores"]))  # every core behind
            refused = await _open(srv)  # judged by every core's guard: each refuses, and sets its cap
            refusal_made.set()
            await asyncio.gather(*senders)
            await _close(clients)
            await _until(srv, lambda b: b["open_streams"] == 0 and b["ready"])  # the delay window has passed

            polls = []  # (when, front end pid, status, caps per core, group cap)
            for _ in range(16):
                status, body = await _readyz(srv)
                polls.append((time.monotonic(), body["pid"], status, _core_caps(body), body["recovering_cap"]))

            held, seen = [], []  # streams held open; (status, body, outcome) per attempt
            # until 4 were refused and both front ends hold some (the kernel picks the front end)
            while sum(isinstance(o, ServerRefused) for *_, o in seen) < 4 or 0 in streams_per_frontend(srv).values():
                status, body = await _readyz(srv)
                outcome = await _open(srv)
                seen.append((status, body, outcome))
                if isinstance(outcome, StreamingClient):
                    held.append(outcome)
                assert len(held) < NUM_SLOTS and len(seen) < 4 * NUM_SLOTS, seen
            per_frontend = streams_per_frontend(srv)
            _, after = await _readyz(srv)
            await _close(held)
            return refused, polls, seen, per_frontend, after

        refused, polls, seen, per_frontend, after = asyncio.run(scenario())
        assert isinstance(refused, ServerRefused) and "behind real time" in str(refused), refused
        assert {pid for _, pid, _, _, _ in polls} == set(frontend_pids(srv)), polls  # both front ends answered
        for _, _, status, caps, group_cap in polls:  # every core's cap, on either front end
            assert status == 200 and None not in caps and group_cap == sum(caps), polls
        for (t0, _, _, caps0, _), (t1, _, _, caps1, _) in zip(polls, polls[1:]):
            for c0, c1 in zip(caps0, caps1):
                assert c0 <= c1 <= c0 + max(1.0, 0.05 * c1) * (t1 - t0) + 1, polls  # one cap, growing at its pace
        for i, (status, body, outcome) in enumerate(seen):
            room = [c for c in body["cores"] if c["free_slots"] > 0]
            admits = any(c["open_streams"] < c["recovering_cap"] for c in room)
            assert None not in _core_caps(body) and (status == 200) == admits, seen
            if status == 200:
                assert isinstance(outcome, StreamingClient), seen
            elif isinstance(outcome, StreamingClient):  # a cap grew (a stream a second) since the read
                assert sum(_core_caps(seen[i + 1][1])) > sum(_core_caps(body)), seen
            else:  # told the cap of the core asked first: the most free slots
                said = int(re.search(r"admitting up to (\d+) open streams", str(outcome)).group(1))
                assert said >= max(room, key=lambda c: c["free_slots"])["recovering_cap"], (said, seen)
        assert len(per_frontend) == 2 and min(per_frontend.values()) > 0, per_frontend  # taken through both
        for c in after["cores"]:  # streams taken through both front ends stop at each core's cap
            assert c["open_streams"] <= c["recovering_cap"], after
        srv.assert_no_leak()
