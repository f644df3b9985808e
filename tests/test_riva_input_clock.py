"""Riva's per-call input clock (server/riva_grpc.py InputClock): one timer per call instead of an
asyncio.wait_for per message, with StreamSession.receive's behaviour: the idle clock fails the
call, the duration clock ends its input, a message within the deadline moves it, a cancel from
elsewhere is not swallowed. A real StreamSession on the in-process engine core."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from nemo_serve.server.riva_grpc import InputClock
from nemo_serve.server.stream_session import Failure, StreamSession

from . import helpers
from .helpers_server import TEST_MODEL
from .helpers_session import PACKET, _next
from .helpers_session import context as _ctx
from .helpers_session import until_slots_free as _until_free

log = logging.getLogger("test")


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


def _run(tiny, settings: dict, body):
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def run():
        session = StreamSession(_ctx(engine, **settings), "riva-t", log)
        assert session.open()
        session.push(np.zeros(PACKET, np.float32))
        clock = InputClock(session)
        try:
            return session, await body(session, clock)
        finally:
            clock.stop()
            session.close()
            await _until_free(engine)

    try:
        return asyncio.run(run())
    finally:
        engine.stop()
        helpers.assert_engine_empty(engine)


def test_the_idle_clock_fails_a_call_whose_client_sends_nothing(tiny):
    async def body(session, clock):
        return await clock.read(asyncio.Event().wait), await _next(session)

    session, (message, event) = _run(tiny, {"idle_timeout_s": 0.2}, body)
    assert message is None
    assert isinstance(event, Failure) and event.label == "idle_timeout"


def test_the_duration_clock_ends_the_input(tiny):
    async def body(session, clock):
        return await clock.read(asyncio.Event().wait)

    session, message = _run(tiny, {"max_stream_s": 0.3, "idle_timeout_s": 30}, body)
    assert message is None and session.failure is None and session.end_reason == "max_stream_duration"


def test_messages_within_the_idle_time_keep_the_call_open(tiny):
    """Eight reads of 0.1 s each against a 0.3 s idle clock armed once: the deadline moves with
    every message (a timer that did not move would cut the fourth read)."""

    async def slow_message():
        await asyncio.sleep(0.1)
        return b"audio"

    async def body(session, clock):
        return [await clock.read(slow_message) for _ in range(8)]

    session, messages = _run(tiny, {"idle_timeout_s": 0.3}, body)
    assert messages == [b"audio"] * 8 and session.failure is None


def test_a_cancel_from_elsewhere_is_not_taken_for_the_clock(tiny):
    async def body(session, clock):
        reader = asyncio.create_task(clock.read(asyncio.Event().wait))
        await asyncio.sleep(0.05)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        return session.failure

    session, failure = _run(tiny, {"idle_timeout_s": 30}, body)
    assert failure is None


def test_a_deadline_passed_between_reads_fails_the_next_read(tiny, caplog):
    """The idle clock rings while the call handles its last message (no read waits): the next read
    returns None and the call fails idle, and the timer's callback raised nothing (asyncio only logs
    an exception in a callback: a ring that cancelled a reader that was not there passed unseen)."""

    async def message():
        return b"audio"

    async def body(session, clock):
        first = await clock.read(message)
        await asyncio.sleep(0.4)  # past the 0.2 s idle deadline, no read waiting
        return first, await clock.read(asyncio.Event().wait), await _next(session)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        session, (first, late, event) = _run(tiny, {"idle_timeout_s": 0.2}, body)
    assert first == b"audio" and late is None
    assert isinstance(event, Failure) and event.label == "idle_timeout"
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
