"""The engine core's socket I/O on its own threads (core/core_io.py, core/core_proc.py run()).

A real EngineCoreProc.run() on a thread of this process, a plain ZMQ front end beside it: every
stream's updates arrive in step order with its `done` last, the slot already free when `done`
arrives, and tokens equal to a solo run; at Stop the results still queued for sending go out and
run() returns; a supervisor that is gone, or a failed I/O thread, ends run() without a hang."""

from __future__ import annotations

import tempfile
import threading
import time

import numpy as np
import pytest
import zmq

from benchmarks.sequence_engine import SequenceEngine, sequence
from nemo_serve.core import core_io
from nemo_serve.core import messages as m
from nemo_serve.core.addresses import control_address, results_address
from nemo_serve.core.core_proc import EngineCoreProc
from nemo_serve.core.shared import FREE, STOPPED, FileLock, SharedLayout, SharedSlots
from nemo_serve.engine.endpoint import EndpointConfig

from . import helpers
from .helpers_server import TEST_MODEL

RING = 16000 * 4


class _Bench:
    """A core running on a thread and the sockets of front end 0."""

    def __init__(self, engine, num_slots: int, parent_pid: int | None = None) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="ns-coreio-")
        self.shared = SharedSlots.create(SharedLayout(num_slots, RING), FileLock(f"{self.ipc_dir}/lock"))
        self.ctx = zmq.Context()
        self.proc = EngineCoreProc(engine, self.shared, self.ipc_dir, self.ctx)
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(results_address(self.ipc_dir, 0))
        self.control = self.ctx.socket(zmq.PUSH)
        self.control.connect(control_address(self.ipc_dir))
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(parent_pid,), daemon=True)
        self.written: dict[int, int] = {}

    def _run(self, parent_pid) -> None:
        try:
            self.proc.run(parent_pid)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error.append(e)

    def start(self) -> "_Bench":
        self.thread.start()
        return self

    def send(self, msg) -> None:
        self.control.send(m.control_encoder.encode(msg))

    def open(self, stream_id: str) -> tuple[int, int]:
        slot, gen = self.shared.allocate(0)
        self.written[slot] = 0
        self.send(m.Open(slot, gen, 0, stream_id, 0, {}))
        return slot, gen

    def push(self, slot_gen: tuple[int, int], samples: np.ndarray) -> None:
        slot, gen = slot_gen
        self.shared.write(slot, self.written[slot], samples)
        self.written[slot] += len(samples)
        self.send(m.Wrote(*(np.array([v], t).tobytes() for v, t in
                            ((slot, m.SLOT), (gen, m.GEN), (self.written[slot], m.POS), (time.time(), m.TIME)))))  # fmt: skip

    def receive(self, timeout_ms: int) -> m.Results | None:
        return m.results_decoder.decode(self.results.recv()) if self.results.poll(timeout_ms) else None

    def updates_until_done(self, timeout_ms: int = 5000) -> list:
        """Every update up to a `done` one; a wait of `timeout_ms` with nothing fails the test."""
        got = []
        while not any(u.done for u in got):
            r = self.receive(timeout_ms)
            assert r is not None
            got.extend(r.updates)
        return got

    def close(self) -> None:
        if self.thread.is_alive():
            self.send(m.Stop())
            self.thread.join(5)
        self.proc.close()
        self.results.close(0)
        self.control.close(0)
        self.ctx.term()
        self.shared.close()


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


def _slow_sends(monkeypatch, delay_s: float, first_s: float | None = None) -> None:
    connect = core_io.CoreIO._connect

    def slow_connect(self, frontend, sockets):
        sockets[frontend] = _SlowSocket(connect(self, frontend, {}), delay_s, first_s)
        return sockets[frontend]

    monkeypatch.setattr(core_io.CoreIO, "_connect", slow_connect)


def test_threaded_core_delivers_each_stream_in_order_slot_freed_before_done(tiny, monkeypatch):
    _slow_sends(monkeypatch, 0.0, first_s=1.0)  # results queue up behind the sender: their order is the queue's
    audios = [a[: 16000 * 2].astype(np.float32) for a in helpers.utterances(3, seed=5)]
    solo = [helpers.drive(helpers.new_engine(tiny, num_slots=1, endpoint=EndpointConfig()), [a]).tokens(0)
            for a in audios]  # fmt: skip
    bench = _Bench(helpers.bare_engine(tiny, 2, EndpointConfig()), num_slots=2).start()
    try:
        slots, updates, free_at_done = {}, {f"s{i}": [] for i in range(3)}, []
        pending = list(enumerate(audios))
        deadline = time.monotonic() + 60
        while any(not u or not u[-1].done for u in updates.values()):
            assert time.monotonic() < deadline, {k: len(v) for k, v in updates.items()}
            if pending and bench.shared.num_free:  # a third stream reuses a freed slot
                i, audio = pending.pop(0)
                slots[f"s{i}"] = bench.open(f"s{i}")
                for k in range(0, len(audio), 1600):
                    bench.push(slots[f"s{i}"], audio[k : k + 1600])
                bench.send(m.Finish(*slots[f"s{i}"]))
            if (r := bench.receive(50)) is not None:
                for u in r.updates:
                    assert not updates[u.stream_id] or not updates[u.stream_id][-1].done  # nothing after done
                    updates[u.stream_id].append(u)
                    if u.done:
                        slot, gen = slots[u.stream_id]
                        free_at_done.append(bench.shared.owner[slot] == FREE or bench.shared.gen[slot] != gen)
        assert len(free_at_done) == 3 and all(free_at_done)
        for i in range(3):
            got = updates[f"s{i}"]
            processed = [u.audio_processed_s for u in got]
            assert processed == sorted(processed), processed  # the steps' order
            assert [t for u in got for t in u.new_token_ids] == solo[i] and solo[i]
    finally:
        bench.close()
    assert not bench.error and bench.shared is not None


class _SlowSocket:
    """A results socket whose sends take a while: the final is still queued when Stop comes."""

    def __init__(self, sock: zmq.Socket, delay_s: float, first_s: float | None = None) -> None:
        self.sock, self.delay_s, self.first_s = sock, delay_s, first_s

    def send(self, data, copy=True):
        time.sleep(self.delay_s if self.first_s is None else self.first_s)
        self.first_s = None
        return self.sock.send(data, copy=copy)

    def close(self, linger=None):
        self.sock.close(linger)


def test_stop_sends_the_queued_final_and_returns(monkeypatch):
    _slow_sends(monkeypatch, 0.1)  # at Stop, several read-end messages and then the final wait to be sent
    bench = _Bench(SequenceEngine(2), num_slots=2).start()
    try:
        a = bench.open("s-1")
        for k in range(0, 4000, 800):
            bench.push(a, sequence("s-1", k, 800))
            time.sleep(0.02)  # a step in between: a Results message with the read end each
        bench.send(m.Finish(*a))
        deadline = time.monotonic() + 10
        while bench.shared.owner[a[0]] != FREE:  # released: its final is handed to the sender
            assert time.monotonic() < deadline
            time.sleep(0.005)
        bench.send(m.Stop())
        t0 = time.monotonic()
        bench.thread.join(5)
        assert not bench.thread.is_alive() and time.monotonic() - t0 < 3
        assert bench.shared.state[0] == STOPPED and not bench.error
        got = []
        while (r := bench.receive(500)) is not None:
            got.extend(r.updates)
        assert [u.done for u in got] == [True] and got[0].error is None and got[0].audio_processed_s == 4000
    finally:
        bench.close()


def test_a_gone_supervisor_ends_run_and_its_io_threads():
    bench = _Bench(SequenceEngine(1), num_slots=1, parent_pid=-1).start()  # never our parent
    try:
        bench.thread.join(5)
        assert not bench.thread.is_alive() and not bench.error
        assert bench.proc.io is not None and not any(t.is_alive() for t in bench.proc.io._threads)
    finally:
        bench.close()


def test_a_failed_io_thread_fails_the_core_instead_of_hanging(monkeypatch):
    def broken_connect(self, frontend, sockets):
        raise zmq.ZMQError(zmq.EINVAL, "broken on purpose")

    monkeypatch.setattr(core_io.CoreIO, "_connect", broken_connect)
    bench = _Bench(SequenceEngine(1), num_slots=1).start()
    try:
        a = bench.open("s-1")
        bench.push(a, sequence("s-1", 0, 100))
        bench.send(m.Finish(*a))
        bench.thread.join(5)
        assert not bench.thread.is_alive()
        assert bench.error and "socket I/O failed" in str(bench.error[0])
    finally:
        bench.close()


def test_core_io_threads_off_keeps_the_io_inline(monkeypatch):
    """NEMO_SERVE_CORE_IO_THREADS=0 (the A/B switch): run() serves without I/O threads."""
    monkeypatch.setenv("NEMO_SERVE_CORE_IO_THREADS", "0")
    before = {t.name for t in threading.enumerate()}
    bench = _Bench(SequenceEngine(1), num_slots=1).start()
    try:
        a = bench.open("s-1")
        bench.push(a, sequence("s-1", 0, 1000))
        bench.send(m.Finish(*a))
        got = bench.updates_until_done()
        assert [u.done for u in got] == [True] and got[0].audio_processed_s == 1000
        assert bench.proc.io is None and not {t.name for t in threading.enumerate()} - before - {bench.thread.name}
    finally:
        bench.close()
    assert bench.shared is not None and not bench.error


def test_a_malformed_control_message_is_dropped_and_the_rest_served(caplog):
    bench = _Bench(SequenceEngine(1), num_slots=1).start()
    try:
        bench.control.send(b"\x93not a control message")
        a = bench.open("s-1")
        bench.push(a, sequence("s-1", 0, 500))
        bench.send(m.Finish(*a))
        got = bench.updates_until_done()
        assert [u.done for u in got] == [True] and got[0].audio_processed_s == 500 and got[0].error is None
    finally:
        bench.close()
    assert not bench.error and "malformed control message dropped" in caplog.text
