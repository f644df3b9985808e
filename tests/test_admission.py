"""Admission under overload (server/admission.py): the guard's state moves only when a stream is
admitted or refused, and /readyz, which only reads it, agrees with what the next stream is told.

The end-to-end test drives a real server whose overload limit is 1 us, so that any stepped chunk
puts it over (real overload takes more streams than CI can afford; benchmarks/overload.py)."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np

from nemo_serve.client import ServerRefused, StreamingClient
from nemo_serve.server.admission import OverloadGuard

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


async def _overload_episode(srv, refuse_one: bool) -> None:
    """EPISODE_STREAMS real-time streams until the engine is behind, /readyz polled all along;
    with `refuse_one` a stream arrives then (and is refused); then every stream ends and the server
    goes idle (the delay window passes)."""
    clients = [await _open(srv) for _ in range(EPISODE_STREAMS)]
    assert all(isinstance(c, StreamingClient) for c in clients), clients
    wire = _audio(3.0)

    async def send(c: StreamingClient) -> None:
        t0 = time.monotonic()
        for i in range(0, len(wire), 1600):
            await c.send_audio(wire[i : i + 1600])
            await asyncio.sleep(max(0.0, t0 + (i + 1600) / 16000 - time.monotonic()))

    senders = [asyncio.create_task(send(c)) for c in clients]
    await _until(srv, lambda b: b["overloaded"])
    for _ in range(5):  # a load balancer's health check
        status, body = await _readyz(srv)
        assert status == 503 and body["queue_delay_s"] > 0, body
    if refuse_one:
        refused = await _open(srv)
        assert isinstance(refused, ServerRefused) and "behind real time" in str(refused), refused
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
