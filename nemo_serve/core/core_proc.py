"""The engine core process: core/engine_core.py's EngineCore inside a ZMQ loop.

One iteration, on the stepping thread:
  1 control messages (open, wrote, finish, force-final, abort, front end gone), without blocking,
    applied to the core (engine_core.apply_control); Stop ends the loop
  2-5 EngineCore.step(), then one Results message per front end with news: its StreamUpdates and,
    with the ring positions in messages, how far the core read its rings (the front end reuses that
    space only then: shared.py says why)
When nothing moved, it waits up to POLL_MS for a control message: audio arriving in a ring
waits at most that long (plus the step that is running) before the core sees it. With the ring
positions in shared memory (shared.py) that wait is the core's poll of them; once no audio has
come for SLEEP_AFTER_S it sleeps up to SLEEP_S instead, and a front end's Wake ends the sleep
(shared.py: the wake-up, no audio left waiting).
`run()` puts the sockets on threads of their own (core/core_io.py: receive and decode, encode and
send), so the stepping thread neither waits on nor encodes for the network; without them
(`iterate_once()` before `start_io()`: tests, benchmarks; NEMO_SERVE_CORE_IO_THREADS=0) the same
iteration does its I/O inline.
This module holds everything the core does over the wire; the core holds none of it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import zmq

from ..collector import tune_collector_for_serving
from ..console import configure_logging
from ..engine.invariants import from_env as invariant_log
from . import messages as m
from .addresses import control_address, results_address
from .core_io import CoreIO
from .engine_core import CoreStep, EngineCore, apply_control
from .shared import FAILED, SERVING, STOPPED, SharedSlots, fence

log = logging.getLogger("nemo_serve.core")

POLL_MS = 2
# Shared positions: after this long without new audio the core sleeps (a poll costs the stepping
# thread a loop iteration; a sleep costs a front end a Wake), and at most this long (the heartbeat
# and the supervisor check run once per iteration).
SLEEP_AFTER_S = 0.05
SLEEP_S = 0.1


class EngineCoreProc:
    """Receives control messages on one PULL socket, sends Results on a PUSH socket per front end."""

    def __init__(self, engine, shared: SharedSlots, ipc_dir: str, zmq_context: zmq.Context | None = None) -> None:
        self.core = EngineCore(engine, shared)
        self.shared = shared
        self.ipc_dir = ipc_dir
        self.on_step = None  # metrics: (batch size, seconds, context_right) of every step
        self._zmq = zmq_context or zmq.Context.instance()
        self.control = self._zmq.socket(zmq.PULL)
        self.control.bind(control_address(ipc_dir))
        self._results: dict[int, zmq.Socket] = {}  # front end -> PUSH socket (inline I/O only)
        self._encoder = m.msgspec.msgpack.Encoder()
        self._own_context = zmq_context is None
        self.io: CoreIO | None = None  # the I/O threads, once start_io() ran
        self._waiting: list = []  # control messages taken by wait_control(), applied by the next take_control()
        self._sleep_epoch = 0  # shared positions: the number of the core's last sleep (shared.core_asleep)

    def start_io(self) -> CoreIO:
        """The sockets on their own threads from now on (core/core_io.py)."""
        self.io = CoreIO(self.control, self._zmq, self.ipc_dir).start()
        return self.io

    @property
    def engine(self):
        return self.core.engine

    def run(self, parent_pid: int | None = None) -> None:
        # NEMO_SERVE_CORE_IO_THREADS=0: the I/O inline on this thread, as before core_io.py (an
        # A/B switch: on the CPU the threads cost more CPU in all than they take off this thread,
        # benchmarks/results/host_bench_core_io_*.json; a GPU run decides)
        if self.io is None and os.environ.get("NEMO_SERVE_CORE_IO_THREADS", "1") != "0":
            self.start_io()
        self.shared.state[0] = SERVING
        last_check = time.monotonic()
        invariants = invariant_log("core")  # tests: NEMO_SERVE_CHECK_INVARIANTS (engine/invariants.py)
        while True:
            taken = self.take_control()
            if taken is None:  # Stop
                break
            busy = self.step() or taken > 0
            if invariants is not None:
                invariants.record(self.core.check_invariants())
            now = time.monotonic()
            self.shared.heartbeat[0] = time.time()
            if parent_pid is not None and now - last_check > 0.5:
                last_check = now
                if os.getppid() != parent_pid:
                    log.error("the supervisor is gone; exiting")
                    break
            if not busy:
                self.idle_wait()
        if self.io is not None:
            self.io.stop()  # after sending what the last steps handed it
        self.shared.state[0] = STOPPED

    def iterate_once(self) -> bool:
        """One iteration without waiting (tests, benchmarks)."""
        taken = self.take_control()
        return self.step() or bool(taken)

    def idle_wait(self) -> None:
        """Nothing to step: poll the shared positions after POLL_MS, or sleep (module docstring)."""
        if not self.core.positions_in_shared or time.monotonic() - self.core.last_audio_s < SLEEP_AFTER_S:
            self.wait_control(POLL_MS / 1000)
        else:
            self.sleep(SLEEP_S)

    def sleep(self, timeout_s: float) -> None:
        """Until a control message (a Wake among them) or `timeout_s`, after saying so in shared
        memory and looking once more: audio published before a front end saw the flag is found
        by that look, audio published after it brings a Wake (shared.py, the wake-up)."""
        self._sleep_epoch += 1
        self.shared.core_asleep[0] = self._sleep_epoch
        fence()  # the flag before the look at the positions
        if not self.core.audio_waiting():
            self.wait_control(timeout_s)
        self.shared.core_asleep[0] = 0

    def wait_control(self, timeout_s: float) -> None:
        """Until a control message has come, or `timeout_s`."""
        if self.io is None:
            self.control.poll(int(timeout_s * 1000))
        elif not self._waiting:
            self._waiting = self.io.take(timeout_s)

    def take_control(self) -> int | None:
        """Every control message waiting, applied to the core; how many (None: Stop came)."""
        msgs, self._waiting = self._waiting + (self.io.take() if self.io else self._receive_inline()), []
        for msg in msgs:
            if isinstance(msg, m.Stop):
                return None
            if isinstance(msg, m.FrontendGone):
                self._close_results(msg.frontend)
            apply_control(self.core, msg)
        return len(msgs)

    def _receive_inline(self) -> list:
        msgs = []
        while True:
            try:
                raw = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            try:
                msgs.append(m.control_decoder.decode(raw))
            except m.msgspec.DecodeError:
                log.error("malformed control message dropped (%d bytes)", len(raw))

    def step(self) -> bool:
        """One core step, each front end's news sent to it; whether the engine is busy."""
        done: CoreStep = self.core.step()
        for frontend, r in done.results.items():  # after step() freed the released slots
            msg = m.Results(r.updates, r.read_slots.astype(m.SLOT).tobytes(), r.read_gens.astype(m.GEN).tobytes(),
                            r.read_ends.astype(m.POS).tobytes())  # fmt: skip
            if self.io is not None:
                self.io.send(frontend, msg)  # encoded and sent on the sender thread
            else:
                self._results_socket(frontend).send(self._encoder.encode(msg), copy=False)
        if self.on_step is not None:
            for st in done.engine.steps:
                self.on_step(st.batch_size, st.elapsed_s, st.context_right)
        return done.busy

    def _results_socket(self, frontend: int) -> zmq.Socket:
        sock = self._results.get(frontend)
        if sock is None:
            sock = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: a dead front end's socket is closed instead
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(results_address(self.ipc_dir, frontend))
            self._results[frontend] = sock
        return sock

    def _close_results(self, frontend: int) -> None:
        if self.io is not None:
            self.io.close_frontend(frontend)
        elif (sock := self._results.pop(frontend, None)) is not None:
            sock.close(0)

    def close(self) -> None:
        stopped = self.io is None or self.io.stop()
        for sock in self._results.values():
            sock.close(0)
        self.control.close(0)
        if self._own_context and stopped:  # waits for the results sockets' linger (core_io.STOP_LINGER_MS): the last finals go out
            self._zmq.term()


def run_core_process(settings, ipc_dir: str, lock, conn, parent_pid: int) -> None:
    """Process entry (spawned by the supervisor): load the model, report, attach, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the core stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(settings.log_level)
    import torch

    from ..compose import load_engine
    from ..model import ModelLoadError, UnsupportedModeError
    from ..server.metrics import StepMetrics

    torch.set_grad_enabled(False)
    try:
        engine = load_engine(settings)  # CUDA: every graph captured before "ready", not during traffic
    except (ModelLoadError, UnsupportedModeError, FileNotFoundError, ValueError) as e:
        conn.send(("error", str(e)))  # the supervisor prints it in one line
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - reported to the supervisor, which prints one line
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(2)
    conn.send(("ready", engine.model_info))
    shm_name, layout = conn.recv()
    shared = SharedSlots.attach(shm_name, layout, lock)
    proc = EngineCoreProc(engine, shared, ipc_dir)
    proc.on_step = StepMetrics().on_step  # into PROMETHEUS_MULTIPROC_DIR, read by the front ends
    tune_collector_for_serving()
    conn.send(("serving", os.getpid()))
    try:
        proc.run(parent_pid)
    except BaseException:
        log.exception("engine core failed")
        shared.state[0] = FAILED
        os._exit(1)
    proc.close()
    os._exit(0)
