"""The engine core in this process: engine_api.EngineAPI over core/engine_core.py's EngineCore.

  any thread                                    the loop thread (start()), or the caller of iterate()
  open_stream: options checked, a slot taken      1 the control messages, in order, applied to the
    in the slot table (NoFreeSlotError /            core (engine_core.apply_control: what the ZMQ
    ValueError at once); push, finish,              loop does with the same messages, decoded)
    force_final, abort: control messages     ->   2 EngineCore.step(): audio, ends, one Engine
    on one queue, the in-process transport            iteration; released slots freed in the table
  results <- consumer(update or StreamResult)  <-  3 this front end's updates to their consumers

The in-process transport for tests, --selftest and benchmarks: the same core class, the same
control messages and the same slot table code as the server (core/core_proc.py, core/client.py),
so they run production code with one delivery order (a slot is free before its stream's `done`
is delivered). What differs is only how things travel: messages through a queue instead of ZMQ
(not encoded), and audio as the pushed arrays themselves instead of a shared-memory ring
(LocalSlots: no ring to fill, so a push never waits for ring space).

A stream's handle stays open here, its id and phrases counted, until the core says it released
the stream (its `done`, or its slot in a step's `released`): a reused id or slot never gets
another stream's results, and aborting leaves the phrases counted until the engine lets them go.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..admission import GuardState, OverloadGuard, Verdict
from ..engine.endpoint import EndpointConfig
from ..engine.invariants import check, from_env as invariant_log
from ..engine.loop import Chunk, Engine
from ..engine.outputs import IterationOutput
from ..engine.results import ResultAssembler, StreamResult, StreamUpdate
from . import messages as m
from .engine_core import EngineCore, FrontendResults, apply_control
from .shared import FREE, SharedLayout, SharedSlots

log = logging.getLogger(__name__)

FRONTEND = 0  # the one front end of an in-process core


class _LocalBlock:
    """What SharedSlots needs of a shared-memory block, in this process's memory."""

    name = "in-process"

    def __init__(self, nbytes: int) -> None:
        self.buf = memoryview(bytearray(nbytes))

    def close(self) -> None:
        pass

    def unlink(self) -> None:
        pass


class LocalSlots(SharedSlots):
    """The slot table of core/shared.py in local memory, with audio kept as the pushed arrays:
    per slot a queue of (generation, samples), the core taking them up to a Wrote's end."""

    def __init__(self, num_slots: int) -> None:
        layout = SharedLayout(num_slots, ring_samples=0)
        super().__init__(_LocalBlock(layout.nbytes), layout, threading.Lock(), owner_of_block=True)
        self.owner[:] = FREE
        self.save_guard(GuardState())
        self._audio: list[deque] = [deque() for _ in range(num_slots)]  # appended by callers, taken by the loop

    def write(self, slot: int, gen: int, samples: np.ndarray) -> None:
        self._audio[slot].append((gen, samples))

    def views(self, slot: int, start: int, end: int) -> tuple[np.ndarray, ...]:
        """The slot's current stream's samples [start, end): the arrays pushed, the last one split
        where a push arrived after the Wrote the core has seen. Samples of the slot's previous
        stream (pushed as it ended) are dropped."""
        gen, chunks, parts, n = self.gen[slot], self._audio[slot], [], end - start
        while n > 0:
            chunk_gen, samples = chunks.popleft()
            if chunk_gen != gen:
                continue
            if len(samples) > n:  # the rest belongs to a later Wrote
                chunks.appendleft((chunk_gen, samples[n:]))
                samples = samples[:n]
            parts.append(samples)
            n -= len(samples)
        return tuple(parts)


@dataclass(eq=False)
class LocalStream:
    """A caller's handle on one stream (what open_stream returns)."""

    stream_id: str
    slot: int
    gen: int
    context_right: int  # its chunk mode, resolved
    num_phrases: int  # boosted phrases it holds (counted against --max-phrases-total here)
    consumer: Callable[[StreamUpdate], None]
    written: int = 0  # samples pushed
    arrival: float = 0.0  # when the newest of them arrived
    finished: bool = False  # caller's side: end of input sent; audio after it is refused
    ended: bool = False  # caller's side: aborted; nothing more is delivered
    released: bool = False  # the core let it go: audio pushed now is dropped


class LocalEngine:
    """engine_api.EngineAPI in this process (module docstring). Driven by its own thread after
    `start()`, or by `iterate()` / `plan()` calls on one thread (the tests)."""

    def __init__(self, engine: Engine, on_step: Callable[[int, float, int | None], None] | None = None,
                 max_queue_delay_s: float = 0.0) -> None:  # fmt: skip
        self.engine = engine
        self.model_info = engine.model_info
        self.on_step = on_step  # metrics hook: (batch size, seconds, the group's context_right) per step
        # Admission's overload guard on this engine's numbers, its state in memory (an engine core's
        # lives in its shared block, core/client.py): a front-end fact, so here, not in the core.
        self.overload_guard = OverloadGuard(max_queue_delay_s, engine.num_slots)
        self.slots = LocalSlots(engine.num_slots)
        self.core = EngineCore(engine, self.slots)
        self._lock = threading.Lock()  # guards the handles below (callers' threads, the loop thread)
        self._by_id: dict[str, LocalStream] = {}  # until the core releases the stream
        self._by_slot: dict[tuple[int, int], LocalStream] = {}  # the same, by (slot, generation)
        self._num_phrases = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # control messages for the loop thread, in order
        # Streams pushed to since the last Wrote: one Wrote for all of them when the loop drains or
        # another message is sent (as a front end sends one per event-loop tick, core/client.py);
        # a Wrote per push cost the loop thread 13 us per stream-step (host_bench, 1000 streams).
        self._unannounced: dict[LocalStream, None] = {}  # an ordered set
        self._send_lock = threading.Lock()  # guards the two above and the order of what enters the inbox
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ streams (any thread)
    def open_stream(
        self,
        on_result: Callable[[StreamResult], None] | Callable[[StreamUpdate], None],
        *,
        stream_id: str | None = None,
        updates: bool = False,
        language: str | None = None,
        endpoint: EndpointConfig | None = None,
        context_right: int | None = None,
        phrases: list[str] | None = None,
        boost: float | None = None,
        diarization: dict | None = None,
    ) -> LocalStream:
        """A stream whose results reach `on_result` on the thread that iterates, each as a
        `StreamResult` (text and the segment's tokens, assembled here) or, if `updates`, each raw
        `StreamUpdate`. NoFreeSlotError or ValueError (bad options, the phrase total, an id
        already open) at once."""
        options = self.engine.check_options(language=language, context_right=context_right, phrases=phrases, boost=boost,
                                            diarization=diarization)  # fmt: skip
        consumer = on_result if updates else _assembling(on_result, self.engine)
        stream_id = stream_id or uuid.uuid4().hex
        with self._lock:
            if stream_id in self._by_id:
                raise ValueError(f"stream id {stream_id!r} is already open")
            error = self.engine.phrase_total_error(self._num_phrases, options.phrases)
            if error is not None:
                raise ValueError(error)
            slot, gen = self.slots.allocate(FRONTEND, options.context_right)  # NoFreeSlotError
            h = LocalStream(stream_id, slot, gen, options.context_right, len(options.phrases.phrases), consumer)
            self._by_id[stream_id] = h
            self._by_slot[slot, gen] = h
            self._num_phrases += h.num_phrases
            ep = dataclasses.asdict(endpoint) if endpoint is not None else None
            # Sent under the lock: another thread's open cannot overtake this one on the queue.
            self._send(m.Open(slot, gen, FRONTEND, stream_id, options.language_index, ep, options.context_right,
                              phrases, boost, diarization))  # fmt: skip
        return h

    def push(self, h: LocalStream, samples: np.ndarray, arrived: float | None = None) -> None:
        """`arrived`: server time the samples came in (default now). The core keeps a reference
        to `samples` (no copy) until it takes them in: the caller must not write to them."""
        if h.finished:
            raise RuntimeError("audio pushed after end of input")
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if h.ended or h.released or not len(samples):
            return
        self.slots.write(h.slot, h.gen, samples)  # first: the Wrote publishes them
        with self._send_lock:
            h.written += len(samples)
            h.arrival = time.time() if arrived is None else arrived
            self._unannounced[h] = None
        if not self._wake.is_set():
            self._wake.set()

    def finish(self, h: LocalStream) -> None:
        h.finished = True
        self._send(m.Finish(h.slot, h.gen))

    def force_final(self, h: LocalStream, at_sample: int | None = None) -> None:
        self._send(m.ForceFinal(h.slot, h.gen, at_sample))

    def abort(self, h: LocalStream, reason: str = "aborted") -> None:
        """No further results are delivered. Idempotent."""
        h.ended = True
        self._send(m.Abort(h.slot, h.gen, reason))

    def _send(self, msg) -> None:
        with self._send_lock:
            self._announce_written()  # first: a Finish must reach the core after the audio it ends
            self._inbox.put(msg)
        # Event.set takes a lock and notifies even when the event is set already; a set event
        # means the loop has not cleared it yet and will iterate (and see this message) after it does.
        if not self._wake.is_set():
            self._wake.set()

    def _announce_written(self) -> None:
        """One Wrote for every stream pushed to since the last (the caller holds _send_lock)."""
        if not self._unannounced:
            return
        hs = list(self._unannounced)
        self._unannounced.clear()
        n = len(hs)
        self._inbox.put(m.Wrote(
            np.fromiter((h.slot for h in hs), m.SLOT, n).tobytes(), np.fromiter((h.gen for h in hs), m.GEN, n).tobytes(),
            np.fromiter((h.written for h in hs), m.POS, n).tobytes(), np.fromiter((h.arrival for h in hs), m.TIME, n).tobytes(),
        ))  # fmt: skip

    # ------------------------------------------------------------------ one iteration (the loop thread)
    def _take_control(self) -> None:
        with self._send_lock:
            self._announce_written()
        inbox = self._inbox
        while True:
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                return
            apply_control(self.core, msg)

    def iterate(self) -> IterationOutput:
        """The messages sent since the last one, one core step, this front end's results delivered."""
        self._take_control()
        done = self.core.step()
        self._deliver(done.results.get(FRONTEND))
        if self.on_step is not None:
            for st in done.engine.steps:
                self.on_step(st.batch_size, st.elapsed_s, st.context_right)
        return done.engine

    def plan(self) -> list[list[Chunk]]:
        """The messages sent since the last iteration and the audio they announce taken in, then
        Engine.plan() (what the next iterate() runs)."""
        self._take_control()
        self.core.take_input()
        return self.engine.plan()

    def _deliver(self, results: FrontendResults | None) -> None:
        """Each update to its stream's consumer (its slot already free when it is the last), then
        the handles of the released streams closed."""
        if results is None:
            return
        by_id = self._by_id
        for update in results.updates:
            h = by_id.get(update.stream_id)
            if h is None:
                continue
            if update.done:
                self._close(h)
            if not h.ended:
                h.consumer(update)
        for slot, gen in results.released:  # aborted ones: no `done` is delivered for them
            if (h := self._by_slot.get((slot, gen))) is not None:
                self._close(h)

    def _close(self, h: LocalStream) -> None:
        with self._lock:
            if self._by_id.get(h.stream_id) is h:
                del self._by_id[h.stream_id]
                del self._by_slot[h.slot, h.gen]
                self._num_phrases -= h.num_phrases
        h.released = True

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> "LocalEngine":
        self._thread = threading.Thread(target=self._run, name="nemo-serve-step-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        invariants = invariant_log("engine")  # tests: NEMO_SERVE_CHECK_INVARIANTS (engine/invariants.py)
        try:
            while not self._stop.is_set():
                busy = self.iterate().busy
                if invariants is not None:
                    invariants.record(self.check_accounting())
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - a dead loop must be visible to the server
            log.exception("step loop crashed")
            self.error = e

    # ------------------------------------------------------------------ load (any thread)
    @property
    def num_slots(self) -> int:
        return self.engine.num_slots

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    @property
    def num_open_streams(self) -> int:
        return len(self._by_id)

    @property
    def queue_delay_s(self) -> float:
        return self.engine.queue_delay_s

    def open_by_mode(self) -> dict[int, int]:
        """Streams opened here and not yet released, by chunk mode (right context)."""
        with self._lock:
            modes = [h.context_right for h in self._by_id.values()]
        return {r: modes.count(r) for r in sorted(set(modes))}

    def overload(self, decide: bool = False, now: float | None = None) -> Verdict:
        """The overload guard on this engine's numbers (engine_api.py)."""
        return self.overload_guard.judge(self.queue_delay_s, self.num_open_streams, now or time.time(), decide)

    def cores(self, now: float | None = None) -> list[dict]:
        """This engine as the one core /readyz and /metrics show (engine_api.CoreStatus)."""
        serving = self.error is None
        return [{"core": 0, "device": str(self.engine.model.device), "pid": os.getpid(), "serving": serving,
                 "free_slots": self.num_free_slots if serving else 0, "total_slots": self.num_slots,
                 "open_streams": self.num_open_streams if serving else 0,
                 "queue_delay_s": round(self.queue_delay_s, 3) if serving else 0.0,
                 "recovering_cap": self.overload(now=now).cap if serving else None}]  # fmt: skip

    @property
    def stats(self):
        return self.engine.stats

    def summary(self) -> str:
        return self.engine.summary()

    # ------------------------------------------------------------------ books (the loop thread, between iterations)
    @property
    def loop_stream_ids(self) -> list[str]:
        """Ids of the streams the Engine holds (opens still queued are not among them)."""
        return self.engine.loop_stream_ids

    def check_accounting(self, exact: bool = False) -> int:
        """Raise AccountingError unless the core's books agree (EngineCore.check_invariants: the
        Engine's own, and the slot table's) and match the handles here: every stream the Engine
        holds is on the slot of the handle with its id. `exact`: also no open still queued (every
        slot taken here is held there). Returns the Engine's open streams."""
        rows = self.core.check_invariants()
        with self._lock:
            allocated = {h.slot: h.stream_id for h in self._by_id.values()}
        taken = self.num_slots - self.slots.num_free
        check(len(allocated) == taken, f"{len(allocated)} streams open here, {taken} slots taken of {self.num_slots}")
        for s in self.engine.slots.streams():
            check(allocated.get(s.slot) == s.stream_id, f"the engine holds stream {s.stream_id} on slot {s.slot}, "
                                                         f"allocated here to {allocated.get(s.slot)}")  # fmt: skip
        check(not exact or len(allocated) == rows, f"{len(allocated)} streams admitted, {rows} taken in")
        return rows


def _assembling(on_result: Callable[[StreamResult], None], engine: Engine):
    assemble = ResultAssembler(engine.detok, engine.geometry.encoder_frame_s)
    return lambda update: on_result(assemble(update))
