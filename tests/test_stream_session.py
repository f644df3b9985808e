"""The transport-neutral streaming session (server/stream_session.py) in ONE process against the
in-process engine core (core/inproc.py): no server process, no socket. Admission, the engine's
finals, backpressure, the clocks, the send deadline, the client leaving, and the slot coming
back after every ending."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from nemo_serve.server import stream_session
from nemo_serve.server.stream_session import Failure, StreamSession

from . import helpers
from .helpers_session import PACKET, _next, run_then_stop
from .helpers_session import context as _ctx
from .helpers_session import until_slots_free as _until_free
from .helpers_server import TEST_MODEL

log = logging.getLogger("test")


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


async def _events_until_end(session: StreamSession, timeout_s: float = 60.0) -> list:
    """Every event up to the `done` result or a Failure."""
    events = []
    async with asyncio.timeout(timeout_s):
        while True:
            event = await session.next_event()
            events.append(event)
            if isinstance(event, Failure) or event.done:
                return events


def _engine_finals(tiny, audio: np.ndarray) -> list[list[int]]:
    """The in-process engine's own finals for `audio`, driven step by step (no session)."""
    engine = helpers.new_engine(tiny, num_slots=2)
    out = helpers.drive(engine, [audio], packet=PACKET)
    return [list(r.token_ids) for r in out.finals(0)]


def test_finals_equal_the_engines_and_the_slot_comes_back(tiny):
    audio = helpers.utterances(1, seed=3)[0]
    expected = _engine_finals(tiny, audio)
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def run():
        session = StreamSession(_ctx(engine), "t1", log)
        assert session.open(interim_results=False)
        for i in range(0, len(audio), PACKET):
            session.push(audio[i : i + PACKET])
        session.end_input()
        events = await _events_until_end(session)
        session.close()
        await _until_free(engine)
        return session, events

    session, events = run_then_stop(engine, run)
    assert session.failure is None and session.end_reason == "end"
    assert all(not isinstance(e, Failure) for e in events)
    assert [list(e.token_ids) for e in events if e.is_final] == expected
    assert all(e.is_final or e.done for e in events)  # interim_results=False: no partial reaches the client
    assert events[-1].done
    helpers.assert_engine_empty(engine)


def test_refused_when_no_slot_is_free_and_the_first_keeps_its_slot(tiny):
    engine = helpers.new_engine(tiny, num_slots=1).start()

    async def run():
        ctx = _ctx(engine)
        first, second = StreamSession(ctx, "t1", log), StreamSession(ctx, "t2", log)
        assert first.open()
        assert not second.open()
        failure = await _next(second)
        assert engine.num_free_slots == 0  # the refusal took nothing from the first
        first.close()
        second.close()
        await _until_free(engine)
        return failure

    failure = run_then_stop(engine, run)
    assert (failure.label, failure.refusal) == ("refused", "no_free_slot")
    helpers.assert_engine_empty(engine)


def test_backpressure_waits_for_the_model(tiny, monkeypatch):
    """Input more than MAX_AHEAD_S ahead of the model: wait_for_model does not return until the
    engine has consumed enough of it."""
    monkeypatch.setattr(stream_session, "MAX_AHEAD_S", 2.0)  # the test model's chunk is 1.12 s
    audio = np.tile(helpers.utterances(1, seed=1)[0], 4)[:4 * 16000]
    assert len(audio) == 4 * 16000
    engine = helpers.new_engine(tiny, num_slots=2)  # not started: the model consumes nothing yet

    async def run():
        session = StreamSession(_ctx(engine), "t1", log)
        assert session.open()
        session.push(audio)  # 4 s ahead
        waiting = asyncio.create_task(session.wait_for_model())
        await asyncio.sleep(0.3)
        blocked = not waiting.done()
        engine.start()
        async with asyncio.timeout(30):
            await waiting
        behind = session.behind_s
        session.close()
        await _until_free(engine)
        return blocked, behind

    blocked, behind = run_then_stop(engine, run)
    assert blocked
    assert behind <= 2.0
    helpers.assert_engine_empty(engine)


def test_idle_timeout_fails_and_frees_the_slot(tiny):
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def run():
        session = StreamSession(_ctx(engine, idle_timeout_s=0.2), "t1", log)
        assert session.open()
        session.push(np.zeros(PACKET, np.float32))
        message = await session.receive(asyncio.Event().wait)  # a client that never sends again
        event = await _next(session)
        session.close()
        await _until_free(engine)
        return message, event

    message, event = run_then_stop(engine, run)
    assert message is None
    assert isinstance(event, Failure) and event.label == "idle_timeout"
    helpers.assert_engine_empty(engine)


def test_duration_cap_ends_input_and_the_stream_still_gets_its_done(tiny):
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def run():
        session = StreamSession(_ctx(engine, max_stream_s=0.3, idle_timeout_s=30), "t1", log)
        assert session.open()
        session.push(helpers.utterances(1)[0][:8000])
        assert await session.receive(asyncio.Event().wait) is None
        events = await _events_until_end(session)
        session.close()
        await _until_free(engine)
        return session, events

    session, events = run_then_stop(engine, run)
    assert session.failure is None and session.end_reason == "max_stream_duration"
    assert events[-1].done
    helpers.assert_engine_empty(engine)


def test_send_deadline_fails_a_client_that_takes_nothing(tiny):
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def run():
        session = StreamSession(_ctx(engine, send_timeout_s=0.1), "t1", log)
        assert session.open()
        sent = await session.send(asyncio.Event().wait())  # a write that never completes
        event = await _next(session)
        session.close()
        await _until_free(engine)
        return sent, event

    sent, event = run_then_stop(engine, run)
    assert sent is False
    assert isinstance(event, Failure) and event.label == "slow_client"
    helpers.assert_engine_empty(engine)


def test_a_write_runs_in_the_senders_task(tiny):
    """session.send puts no task of its own around a write (one per result message, issue 48)."""
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def run():
        session = StreamSession(_ctx(engine), "t1", log)
        ran_in = []

        async def write():
            ran_in.append(asyncio.current_task())

        sent = await session.send(write())
        session.close()
        await _until_free(engine)
        return sent, ran_in, asyncio.current_task()

    sent, ran_in, sender = run_then_stop(engine, run)
    assert sent is True and ran_in == [sender]
    helpers.assert_engine_empty(engine)


def test_a_client_that_stops_reading_fails_when_the_outbox_is_full(tiny):
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def run():
        session = StreamSession(_ctx(engine), "t1", log, max_queued=3)
        assert session.open()
        for i in range(4):
            session.queue({"message": i})
        event = await _next(session)
        session.close()
        await _until_free(engine)
        return event

    event = run_then_stop(engine, run)
    assert isinstance(event, Failure) and event.label == "slow_client"
    helpers.assert_engine_empty(engine)


def test_client_gone_aborts_the_stream_mid_utterance(tiny):
    audio = helpers.utterances(1, seed=2)[0]
    engine = helpers.new_engine(tiny, num_slots=1).start()

    async def run():
        session = StreamSession(_ctx(engine), "t1", log)
        assert session.open()
        session.push(audio[: len(audio) // 2])
        await asyncio.sleep(0.2)
        session.gone()
        await _until_free(engine)  # before close(): leaving aborts at once
        session.close()
        return session

    session = run_then_stop(engine, run)
    assert session.failure is None and session.client_gone
    assert len(session.outbox) == 0 or not any(getattr(e, "done", False) for e in session.outbox._items)
    helpers.assert_engine_empty(engine)


def test_drain_ends_input_of_an_open_stream_and_refuses_one_not_yet_admitted(tiny):
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def run():
        ctx = _ctx(engine)
        admitted, waiting = StreamSession(ctx, "t1", log), StreamSession(ctx, "t2", log)
        assert admitted.open()
        admitted.push(helpers.utterances(1)[0][:8000])
        admitted.drain()
        waiting.drain()
        events = await _events_until_end(admitted)
        failure = await _next(waiting)
        for s in (admitted, waiting):
            s.close()
        await _until_free(engine)
        return admitted, events, failure

    admitted, events, failure = run_then_stop(engine, run)
    assert admitted.end_reason == "draining" and events[-1].done
    assert isinstance(failure, Failure) and failure.label == "draining"
    helpers.assert_engine_empty(engine)
