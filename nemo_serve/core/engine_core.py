"""The engine core process: the Engine, driven by a loop that never touches the network.

One iteration:
  1 control messages (open, finish, force-final, abort, front end gone), without blocking
  2 audio: the slots whose ring end moved (the front ends' Wrote messages of step 1; one array
    comparison over the slots), copied out of shared memory into the streams' buffers, with the
    front end's arrival time
  3 ends of input (after 2, so a stream's last packet is in before its end)
  4 Engine.iterate(): scheduling as array operations, features, one batched step per group; it
    returns what it produced (engine/outputs.py), which this loop routes: updates to their slot's
    front end, released streams' slots back to the slot table, step statistics to the metrics,
    the queue delay into shared memory
  5 one results message per front end with the StreamUpdates of its streams and how far step 2
    read their rings (the front end reuses that space only then: shared.py says why)
When nothing moved, it waits up to POLL_MS for a control message: audio arriving in a ring
waits at most that long (plus the step that is running) before the core sees it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections import defaultdict

import numpy as np
import zmq

from ..console import configure_logging
from ..engine.endpoint import EndpointConfig
from ..engine.invariants import check, from_env as invariant_log
from ..engine.results import StreamUpdate
from . import messages as m
from .addresses import control_address, results_address
from .shared import FAILED, FREE, SERVING, STOPPED, SharedLayout, SharedSlots

log = logging.getLogger("nemo_serve.core")

POLL_MS = 2
_NO_SLOTS = np.zeros(0, dtype=np.int64)


class EngineCore:
    def __init__(self, engine, shared: SharedSlots, ipc_dir: str, zmq_context: zmq.Context | None = None) -> None:
        if engine.num_slots != shared.num_slots:  # one slot table: a front end's slot is the cache row
            raise ValueError(f"the engine has {engine.num_slots} slots, the shared table {shared.num_slots}")
        self.engine = engine
        self.shared = shared
        self.ipc_dir = ipc_dir
        self.on_step = None  # metrics: (batch size, seconds, context_right) of every step
        self._zmq = zmq_context or zmq.Context.instance()
        self.control = self._zmq.socket(zmq.PULL)
        self.control.bind(control_address(ipc_dir))
        # A front end's slot is the stream's slot in the engine (cache row, scheduler row): which
        # stream holds it is the engine's slot table (engine.slots), nowhere here. The core's own
        # per-slot facts: the generation and front end of the stream it opened there, and the ring
        # positions (shared.py: they travel in messages).
        self._gen = np.zeros(shared.num_slots, dtype=np.int64)
        self._frontend_of = np.full(shared.num_slots, -1, dtype=np.int64)
        self._write_end = np.zeros(shared.num_slots, dtype=np.int64)  # samples the front end says it wrote
        self._read_end = np.zeros(shared.num_slots, dtype=np.int64)  # samples copied out of the ring
        self._arrival = np.zeros(shared.num_slots, dtype=np.float64)  # when the newest written ones arrived
        self._read_slots: list[np.ndarray] = []  # slots read this iteration: reported in step 5
        self._finishes: list = []  # streams whose end of input arrived this iteration
        self._outgoing: dict[int, list[StreamUpdate]] = defaultdict(list)  # front end -> updates
        self._results: dict[int, zmq.Socket] = {}  # front end -> PUSH socket
        self._gone: set[int] = set()  # front ends that died
        self._encoder = m.msgspec.msgpack.Encoder()

    # ------------------------------------------------------------------ the loop
    def run(self, parent_pid: int | None = None) -> None:
        self.shared.state[0] = SERVING
        last_check = time.monotonic()
        invariants = invariant_log("core")  # tests: NEMO_SERVE_CHECK_INVARIANTS (engine/invariants.py)
        while True:
            busy = self._take_control()
            if busy is None:  # Stop
                break
            self._take_audio()
            self._apply_finishes()
            busy = self._iterate_engine() or busy
            self._send_results()
            if invariants is not None:
                invariants.record(self.check_invariants())
            now = time.monotonic()
            self.shared.heartbeat[0] = time.time()
            if parent_pid is not None and now - last_check > 0.5:
                last_check = now
                if os.getppid() != parent_pid:
                    log.error("the supervisor is gone; exiting")
                    break
            if not busy:
                self.control.poll(POLL_MS)
        self.shared.state[0] = STOPPED

    def iterate_once(self) -> bool:
        """One iteration without waiting (tests)."""
        busy = self._take_control()
        self._take_audio()
        self._apply_finishes()
        busy = self._iterate_engine() or bool(busy)
        self._send_results()
        return busy

    # ------------------------------------------------------------------ 4 the engine, its output routed
    def _iterate_engine(self) -> bool:
        # While the engine steps, the figure the front ends read must stand however long the step
        # takes (a step longer than the window is not an idle engine: queue_delay.py), so its
        # validity is open-ended until the engine returns the pair as its steps left it.
        queue_delay = self.shared.queue_delay
        queue_delay[:] = (self.shared.queue_delay_s(time.time()), math.inf)
        out = self.engine.iterate()
        queue_delay[:] = out.queue_delay
        if out.updates:
            self._route(out.updates, self._frontend_of[np.array(out.update_slots, dtype=np.int64)])
        if out.released:  # the engine gave these slots back; so are their rings
            self.shared.free([r.slot for r in out.released])
        if self.on_step is not None:
            for st in out.steps:
                self.on_step(st.batch_size, st.elapsed_s, st.context_right)
        return out.busy

    def _route(self, updates: tuple, frontends: np.ndarray) -> None:
        """Each update to its front end's outgoing list, in order: a front end's updates are one
        list slice when they all go there (the usual case), else picked with one mask each."""
        outgoing = self._outgoing
        if (frontends == frontends[0]).all():
            outgoing[int(frontends[0])].extend(updates)
            return
        for frontend in np.unique(frontends).tolist():
            outgoing[frontend].extend(updates[i] for i in np.flatnonzero(frontends == frontend).tolist())

    def check_invariants(self) -> int:
        """Raise AccountingError unless the engine's books agree (Engine.check_accounting) and
        match the shared slot table: every slot the engine holds a stream on is owned there by
        the front end that opened the stream, at its generation. Front ends only ever take free
        slots, and only this thread frees them, so the slots checked here cannot change under it.
        Returns the streams holding a cache row. Between iterations."""
        rows = self.engine.check_accounting()
        sh = self.shared
        held = np.flatnonzero(self.engine.slots.held)
        owned = int(np.count_nonzero(sh.owner != FREE))
        check(len(held) == rows and rows <= owned <= sh.num_slots,
              f"{rows} streams hold cache rows, {len(held)} engine slots held, {owned} of {sh.num_slots} shared slots owned")  # fmt: skip
        wrong = held[(sh.owner[held] != self._frontend_of[held]) | (sh.gen[held] != self._gen[held])]
        for slot in wrong.tolist():
            check(False, f"slot {slot} serves front end {int(self._frontend_of[slot])}'s stream at generation "
                         f"{int(self._gen[slot])}; the table says owner {int(sh.owner[slot])} generation {int(sh.gen[slot])}")  # fmt: skip
        return rows

    # ------------------------------------------------------------------ 1 control
    def _take_control(self) -> bool | None:
        busy = False
        while True:
            try:
                raw = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return busy
            busy = True
            try:
                msg = m.control_decoder.decode(raw)
            except m.msgspec.DecodeError:
                log.error("malformed control message dropped (%d bytes)", len(raw))
                continue
            if isinstance(msg, m.Stop):
                return None
            self._on_control(msg)

    def _on_control(self, msg) -> None:
        if isinstance(msg, m.Wrote):
            self._wrote(msg)
        elif isinstance(msg, m.Open):
            self._open(msg)
        elif isinstance(msg, m.FrontendGone):
            self._frontend_gone(msg.frontend)
        else:
            stream = self._stream_at(msg.slot, msg.gen)
            if stream is None:
                return  # the stream already ended (its slot may have a new one): nothing to do
            if isinstance(msg, m.Finish):
                self._finishes.append(stream)
            elif isinstance(msg, m.ForceFinal):
                self.engine.force_final(stream)
            elif isinstance(msg, m.Abort):
                self.engine.abort(stream, msg.reason)

    def _open(self, msg: m.Open) -> None:
        if msg.frontend in self._gone:  # sent just before its front end died
            self._free_if_held(msg.slot, msg.gen)
            return
        try:
            self.engine.admit(
                slot=msg.slot,
                stream_id=msg.stream_id,
                language_index=msg.language_index,
                endpoint=EndpointConfig(**msg.endpoint),
                context_right=msg.context_right,
                phrases=msg.phrases,
                boost=msg.boost,
            )
        except (RuntimeError, ValueError, TypeError) as e:  # a sane front end: only the server-wide phrase limit
            log.error("open refused for slot %d: %s", msg.slot, e)
            self._outgoing[msg.frontend].append(StreamUpdate(msg.stream_id, 0, True, True, [], [], 0, 0.0, time.time(), error=str(e)))
            self._free_if_held(msg.slot, msg.gen)
            return
        self._gen[msg.slot], self._frontend_of[msg.slot] = msg.gen, msg.frontend
        self._write_end[msg.slot] = self._read_end[msg.slot] = 0
        if msg.frontend not in self._results:
            sock = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: a dead front end's socket is closed instead
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(results_address(self.ipc_dir, msg.frontend))
            self._results[msg.frontend] = sock

    def _frontend_gone(self, frontend: int) -> None:
        self._gone.add(frontend)
        served = self.engine.slots.held & (self._frontend_of == frontend)
        for slot in np.flatnonzero(served).tolist():
            self.engine.abort(self.engine.slots.stream_at(slot), "front end died")
        n = int(served.sum())
        owned = np.flatnonzero(self.shared.owner == frontend)
        orphans = [int(s) for s in owned if not served[s]]  # allocated, never opened
        if orphans:
            self.shared.free(orphans)
        sock = self._results.pop(frontend, None)
        if sock is not None:
            sock.close(0)
        self._outgoing.pop(frontend, None)
        log.warning("front end %d gone: %d streams aborted, %d slots freed", frontend, n, len(orphans))

    def _free_if_held(self, slot: int, gen: int) -> None:
        with self.shared.lock:
            if self.shared.gen[slot] == gen and self.shared.owner[slot] != FREE:
                self.shared.owner[slot] = FREE

    def _stream_at(self, slot: int, gen: int):
        """The stream this core opened on `slot` at generation `gen`, if it is still open."""
        if not 0 <= slot < len(self._gen) or self._gen[slot] != gen:
            return None
        return self.engine.slots.stream_at(slot)

    def _wrote(self, msg: m.Wrote) -> None:
        """A front end's new ring ends; received after it wrote the samples (shared.py)."""
        slots = np.frombuffer(msg.slots, m.SLOT)
        gens, ends = np.frombuffer(msg.gens, m.GEN), np.frombuffer(msg.ends, m.POS)
        arrivals = np.frombuffer(msg.arrivals, m.TIME)
        if not len(slots) == len(gens) == len(ends) == len(arrivals) or not np.all((slots >= 0) & (slots < len(self._gen))):
            log.error("malformed Wrote message dropped (%d slots)", len(slots))
            return
        # A stream that ended meanwhile (its slot closed, or reused: another generation) is skipped.
        live = self.engine.slots.held[slots] & (self._gen[slots] == gens)
        slots = slots[live]
        self._write_end[slots] = ends[live]
        self._arrival[slots] = arrivals[live]

    # ------------------------------------------------------------------ 2-3 audio
    def _take_audio(self) -> None:
        active = np.flatnonzero(self.engine.slots.held)
        if active.size == 0:
            return
        ends = self._write_end[active]
        moved = ends != self._read_end[active]
        slots, ends = active[moved], ends[moved]
        if slots.size == 0:
            return
        starts, arrivals = self._read_end[slots].tolist(), self._arrival[slots].tolist()
        stream_at = self.engine.slots.by_slot
        for slot, start, end, arrived in zip(slots.tolist(), starts, ends.tolist(), arrivals):
            # One copy, ring -> the stream's buffer; step 5 then tells the front end the space is free.
            self.engine.take_audio(stream_at[slot], self.shared.views(slot, start, end), arrived)
        self._read_end[slots] = ends
        self._read_slots.append(slots)

    def _apply_finishes(self) -> None:
        for stream in self._finishes:
            self.engine.finish(stream)
        self._finishes.clear()

    # ------------------------------------------------------------------ 5 results
    def _send_results(self) -> None:
        read = self._read_slots[0] if len(self._read_slots) == 1 else np.concatenate(self._read_slots or [_NO_SLOTS])
        self._read_slots.clear()
        read_by = self._frontend_of[read]
        for frontend in self._outgoing.keys() | set(np.unique(read_by).tolist() if read.size else ()):
            updates, slots = self._outgoing.get(frontend), read[read_by == frontend]
            if not updates and not slots.size:
                continue
            sock = self._results.get(frontend)
            if sock is not None:
                msg = m.Results(updates or [], slots.astype(m.SLOT).tobytes(), self._gen[slots].tobytes(),
                                self._read_end[slots].tobytes())  # fmt: skip
                sock.send(self._encoder.encode(msg), copy=False)
            if updates:
                updates.clear()

    def close(self) -> None:
        for sock in self._results.values():
            sock.close(0)
        self.control.close(0)


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
    core = EngineCore(engine, shared, ipc_dir)
    core.on_step = StepMetrics().on_step  # into PROMETHEUS_MULTIPROC_DIR, read by the front ends
    conn.send(("serving", os.getpid()))
    try:
        core.run(parent_pid)
    except BaseException:
        log.exception("engine core failed")
        shared.state[0] = FAILED
        os._exit(1)
    core.close()
    os._exit(0)


def ring_layout(settings, sample_rate: int) -> SharedLayout:
    return SharedLayout(settings.num_slots, int(settings.audio_ring_s * sample_rate))
