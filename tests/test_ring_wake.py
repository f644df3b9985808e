"""Ring positions in shared memory and the core's wake-up (core/shared.py, "Wake-up").

The real EngineClient on asyncio and the real EngineCoreProc (its Engine the ring bench's
SequenceEngine, which checks every sample), on one thread, so each interleaving is set up by hand:
  - audio published before the core says it sleeps: no Wake was sent (nobody slept), so only the
    core's second look at the positions keeps the audio from waiting for the sleep's timeout;
  - audio published while the core sleeps: one Wake per sleep and front end, and it ends the sleep;
  - a position stored by the slot's previous stream (another generation) is not taken;
  - a Finish right after the audio it ends: the core takes the audio first, and no Wrote is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from benchmarks.sequence_engine import SequenceEngine, model_info, sequence
from nemo_serve.core import messages as m
from nemo_serve.core.addresses import control_address
from nemo_serve.core.client import EngineClient
from nemo_serve.core.core_proc import EngineCoreProc
from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots

RING = 4096
LONG_SLEEP_S = 5.0  # what a lost wake-up would cost here; the tests allow a small share of it


def _shared(ipc_dir: str, num_slots: int = 2) -> SharedSlots:
    return SharedSlots.create(SharedLayout(num_slots, RING, positions_in_shared=True), FileLock(f"{ipc_dir}/lock"))


def _open(proc: EngineCoreProc, client: EngineClient, stream_id: str, on_result=lambda r: None):
    """A stream the core holds (its Open taken: it travels through a socket)."""
    h = client.open_stream(on_result, stream_id=stream_id)
    for _ in range(100):
        proc.control.poll(20)
        proc.iterate_once()
        if proc.engine.slots.held[h.slot]:
            return h
    raise AssertionError("the core never took the Open")


@contextlib.contextmanager
def _core_and_front_end():
    """The real EngineCoreProc (its Engine a SequenceEngine over 2 slots) and EngineClient on shared
    positions, on this thread; closed in the order the tests need: client, core, context, memory."""
    ipc_dir = tempfile.mkdtemp(prefix="ns-wake-")
    shared, ctx = _shared(ipc_dir), zmq.Context()
    proc = EngineCoreProc(SequenceEngine(2), shared, ipc_dir, ctx)
    client = EngineClient(model_info(), shared, 0, ipc_dir).start()
    try:
        yield shared, proc, client
    finally:
        client.stop()
        proc.close()
        ctx.term()
        shared.close()


def test_audio_published_before_the_core_sleeps_is_found_by_its_second_look():
    async def run():
        with _core_and_front_end() as (shared, proc, client):
            h = _open(proc, client, "s-1")
            for start, n in ((0, 800), (800, 1)):  # a single waiting sample counts too
                client.push(h, sequence("s-1", start, n))  # the core is awake: no Wake
                assert shared.core_asleep[0] == 0
                t0 = time.monotonic()
                proc.sleep(LONG_SLEEP_S)  # nothing in its inbox: only the look at the positions ends it
                slept_s = time.monotonic() - t0
                assert slept_s < LONG_SLEEP_S / 10, f"the core slept {slept_s:.2f} s with {n} samples in a ring"
                assert shared.core_asleep[0] == 0  # awake again: front ends send no Wake now
                proc.iterate_once()
                assert proc.core._read_end[h.slot] == start + n and int(shared.read_end[h.slot]) == start + n

    asyncio.run(run())


def test_a_sleeping_core_gets_one_wake_per_sleep_and_wakes_on_it():
    async def run():
        with _core_and_front_end() as (shared, proc, client):
            h = _open(proc, client, "s-2")
            proc.start_io()  # the core's sleep waits on its receiver thread's inbox, as in run()
            slept: list[float] = []

            def sleep_once():
                t0 = time.monotonic()
                proc.sleep(LONG_SLEEP_S)
                slept.append(time.monotonic() - t0)

            sleeper = threading.Thread(target=sleep_once)
            sleeper.start()
            for _ in range(500):  # until it has said it sleeps
                if shared.core_asleep[0]:
                    break
                await asyncio.sleep(0.002)
            epoch = int(shared.core_asleep[0])
            assert epoch, "the core never said it sleeps"
            for i in range(3):  # three packets in this sleep: one Wake
                client.push(h, sequence("s-2", 320 * i, 320))
            sleeper.join(LONG_SLEEP_S * 2)
            assert slept and slept[0] < LONG_SLEEP_S / 10, f"the core slept {slept} s after a Wake"
            msgs = proc._waiting + proc.io.take(0.5)
            assert [type(x).__name__ for x in msgs] == ["Wake"], msgs
            proc._waiting = []
            proc.iterate_once()
            assert proc.core._read_end[h.slot] == 960

    asyncio.run(run())


def test_a_new_sleep_gets_a_new_wake_and_an_awake_core_none(tmp_path):
    """The front end's side alone, against a bare socket: epochs set by hand."""

    async def run():
        shared = _shared(str(tmp_path))
        ctx = zmq.asyncio.Context()
        core = ctx.socket(zmq.PULL)
        core.bind(control_address(str(tmp_path)))
        client = EngineClient(model_info(), shared, 0, str(tmp_path)).start()
        try:
            h = client.open_stream(lambda r: None, stream_id="s-3")
            packet = np.zeros(160, np.float32)
            for epoch in (0, 7, 7, 0, 8, 8, 8):
                shared.core_asleep[0] = epoch
                client.push(h, packet)
                await asyncio.sleep(0.003)  # a tick and more than a Wrote period: a Wrote would have gone
            kinds = []
            while await core.poll(200):
                kinds.append(type(m.control_decoder.decode(await core.recv())).__name__)
            return kinds
        finally:
            client.stop()
            core.close(0)
            ctx.term()
            shared.close()

    assert asyncio.run(run()) == ["Open", "Wake", "Wake"]


def test_a_position_of_the_slots_previous_stream_is_not_taken(tmp_path):
    shared = _shared(str(tmp_path))
    try:
        slot, gen = shared.allocate(0)
        shared.publish_write(slot, gen - 1, 999, 0.0)  # the previous stream's late store
        slots, fallback = np.array([slot]), np.array([0])
        assert shared.written(slots, np.array([gen]), fallback).tolist() == [0]
        shared.publish_write(slot, gen, 640, 0.0)
        assert shared.written(slots, np.array([gen]), fallback).tolist() == [640]
    finally:
        shared.close()


def test_a_finish_right_after_its_audio_gets_all_of_it(tmp_path):
    """No Wrote in shared positions; the Finish still ends the stream after its last packet."""

    async def run():
        got = []
        with _core_and_front_end() as (shared, proc, client):
            h = _open(proc, client, "s-4", got.append)
            for i in range(10):
                client.push(h, sequence("s-4", 100 * i, 100))
            client.finish(h)
            for _ in range(200):
                proc.control.poll(5)
                proc.iterate_once()
                await asyncio.sleep(0.001)
                if got:
                    break
        return got

    got = asyncio.run(run())
    assert got and got[-1].done and got[-1].error is None, got
    assert got[-1].audio_processed_s == 1000  # SequenceEngine reports the samples it took


def test_the_switch_picks_the_way_and_refuses_a_misspelling(monkeypatch):
    from nemo_serve.core import shared as shared_module

    monkeypatch.setenv("NEMO_SERVE_RING_POSITIONS", "messages")
    assert shared_module.positions_in_shared_default() is False
    monkeypatch.setenv("NEMO_SERVE_RING_POSITIONS", "shared")
    assert shared_module.positions_in_shared_default() is True
    monkeypatch.setenv("NEMO_SERVE_RING_POSITIONS", "shm")
    with pytest.raises(ValueError, match="NEMO_SERVE_RING_POSITIONS"):
        shared_module.positions_in_shared_default()
    monkeypatch.delenv("NEMO_SERVE_RING_POSITIONS")
    for machine, expected in (("x86_64", True), ("aarch64", False)):
        monkeypatch.setattr(shared_module.platform, "machine", lambda m=machine: m)
        assert shared_module.positions_in_shared_default() is expected
