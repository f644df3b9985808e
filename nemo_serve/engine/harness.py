"""The engine in this process: engine_api.EngineAPI over an Engine, for tests, --selftest and benchmarks.

  any thread                                   the loop thread (start()), or the caller of iterate()
  open_stream: options checked, a slot taken     1 the calls, in order, applied to the Engine
    (NoFreeSlotError / ValueError at once)      -> (admit, take_audio, finish, force_final, abort)
  push / finish / force_final / abort         2 Engine.iterate()
                                              3 each update to its stream's consumer, released
  results <- consumer(update or StreamResult) <-  slots given back here, steps to on_step

It plays the part the front ends and the engine core play between processes (core/client.py,
core/engine_core.py): it allocates slots itself, lowest free first, under its own lock, as a front
end allocates them in shared memory for the core, so a full engine refuses in the caller's thread;
it checks a stream's options there too (Engine.check_options is pure). Everything else crosses to
the thread that owns the Engine through one queue, so the Engine stays single-threaded and sees
each stream's calls in the order they were made. A slot is given back here when the Engine's
output says it released the stream: until then the slot and the stream id stay taken, so a reused
id or slot never gets another stream's results.
"""

from __future__ import annotations

import heapq
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .endpoint import EndpointConfig
from .errors import NoFreeSlotError
from .invariants import check, from_env as invariant_log
from .loop import Chunk, Engine
from .outputs import IterationOutput
from .results import ResultAssembler, StreamResult, StreamUpdate
from .stream import Stream
from ..admission import OverloadGuard, Verdict

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LocalStream:
    """A caller's handle on one stream (what open_stream returns)."""

    stream_id: str
    slot: int
    context_right: int  # its chunk mode, resolved
    num_phrases: int  # boosted phrases it holds (counted against --max-phrases-total here)
    consumer: Callable[[StreamUpdate], None]
    finished: bool = False  # caller's side: end of input sent; audio after it is refused
    ended: bool = False  # caller's side: aborted; nothing more is delivered
    stream: Stream | None = None  # the Engine's, set on the loop thread when the open is applied


class LocalEngine:
    """engine_api.EngineAPI in this process (module docstring). Driven by its own thread after
    `start()`, or by `iterate()` / `plan()` calls on one thread (the tests)."""

    def __init__(self, engine: Engine, on_step: Callable[[int, float, int | None], None] | None = None,
                 max_queue_delay_s: float = 0.0) -> None:  # fmt: skip
        self.engine = engine
        self.model_info = engine.model_info
        self.on_step = on_step  # metrics hook: (batch size, seconds, the group's context_right) per step
        # Admission's overload guard on this engine's numbers, its state in memory (an engine core's
        # lives in its shared block, core/client.py): a front-end fact, so here, not in the Engine.
        self.overload_guard = OverloadGuard(max_queue_delay_s, engine.num_slots)
        self._lock = threading.Lock()  # guards the allocation below (callers' threads, the loop thread)
        self._free = list(range(engine.num_slots))  # heap: lowest slot first
        self._by_slot: list[LocalStream | None] = [None] * engine.num_slots  # until its release is delivered
        self._by_id: dict[str, LocalStream] = {}  # the same handles, by stream id
        self._num_phrases = 0
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (method, args) for the loop thread, in order
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
    ) -> LocalStream:
        """A stream whose results reach `on_result` on the thread that iterates, each as a
        `StreamResult` (text and the segment's tokens, assembled here) or, if `updates`, each raw
        `StreamUpdate`. NoFreeSlotError or ValueError (bad options, the phrase total, an id
        already open) at once."""
        options = self.engine.check_options(language=language, context_right=context_right, phrases=phrases, boost=boost)
        consumer = on_result if updates else _assembling(on_result, self.engine)
        stream_id = stream_id or uuid.uuid4().hex
        with self._lock:
            if stream_id in self._by_id:
                raise ValueError(f"stream id {stream_id!r} is already open")
            error = self.engine.phrase_total_error(self._num_phrases, options.phrases)
            if error is not None:
                raise ValueError(error)
            if not self._free:
                raise NoFreeSlotError(f"all {self.engine.num_slots} slots are in use")
            h = LocalStream(stream_id, heapq.heappop(self._free), options.context_right, len(options.phrases.phrases),
                            consumer)  # fmt: skip
            self._by_slot[h.slot] = h
            self._by_id[stream_id] = h
            self._num_phrases += h.num_phrases
        self._call(self._admit, h, endpoint, options, phrases, boost)
        return h

    def push(self, h: LocalStream, samples: np.ndarray, arrived: float | None = None) -> None:
        """`arrived`: server time the samples came in (default now). The engine keeps a reference
        to `samples` (no copy) until the loop takes them in: the caller must not write to them."""
        if h.finished:
            raise RuntimeError("audio pushed after end of input")
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        self._call(self._take_audio, h, samples, time.time() if arrived is None else arrived)

    def finish(self, h: LocalStream) -> None:
        h.finished = True
        self._call(self._finish, h, time.time())

    def force_final(self, h: LocalStream) -> None:
        self._call(self._force_final, h)

    def abort(self, h: LocalStream, reason: str = "aborted") -> None:
        """No further results are delivered. Idempotent."""
        h.ended = True
        self._call(self._abort, h, reason)

    def _call(self, method, *args) -> None:
        self._calls.put((method, args))
        # Event.set takes a lock and notifies even when the event is set already; a set event
        # means the loop has not cleared it yet and will iterate (and see this call) after it does.
        if not self._wake.is_set():
            self._wake.set()

    # ------------------------------------------------------------------ the calls, on the loop thread
    def _apply_calls(self) -> None:
        calls = self._calls
        while True:
            try:
                method, args = calls.get_nowait()
            except queue.Empty:
                return
            method(*args)

    def _admit(self, h: LocalStream, endpoint, options, phrases, boost) -> None:
        try:
            h.stream = self.engine.admit(slot=h.slot, stream_id=h.stream_id, language_index=options.language_index,
                                         endpoint=endpoint, context_right=options.context_right, phrases=phrases,
                                         boost=boost)  # fmt: skip
        except ValueError as e:  # checked at open: only a bug gets here; the stream ends, the loop goes on
            log.error("open refused for slot %d: %s", h.slot, e)
            if not h.ended:
                h.consumer(StreamUpdate(h.stream_id, 0, True, True, [], [], 0, 0.0, time.time(), error=str(e)))
            self._give_back(h)

    def _open(self, h: LocalStream) -> Stream | None:
        """The handle's stream while the Engine holds it (None once released: calls after that are void)."""
        s = h.stream
        return s if s is not None and self.engine.slots.holds(s) else None

    def _take_audio(self, h: LocalStream, samples: np.ndarray, arrived: float) -> None:
        if (s := self._open(h)) is not None:
            self.engine.take_audio(s, (samples,), arrived)

    def _finish(self, h: LocalStream, at: float) -> None:
        if (s := self._open(h)) is not None:
            self.engine.finish(s, at)

    def _force_final(self, h: LocalStream) -> None:
        if (s := self._open(h)) is not None:
            self.engine.force_final(s)

    def _abort(self, h: LocalStream, reason: str) -> None:
        if (s := self._open(h)) is not None:
            self.engine.abort(s, reason)

    # ------------------------------------------------------------------ one iteration
    def iterate(self) -> IterationOutput:
        """The calls made since the last one, then one Engine iteration, its output delivered."""
        self._apply_calls()
        out = self.engine.iterate()
        self._deliver(out)
        return out

    def plan(self) -> list[list[Chunk]]:
        """The calls made since the last iteration, then Engine.plan()."""
        self._apply_calls()
        return self.engine.plan()

    def _deliver(self, out: IterationOutput) -> None:
        """Each update to its stream's consumer, then the released streams' slots back here (no
        slot is taken again before: admission is applied between iterations), the steps to on_step."""
        by_slot = self._by_slot
        for update, slot in zip(out.updates, out.update_slots):
            h = by_slot[slot]
            if h is not None and not h.ended:
                h.consumer(update)
        for released in out.released:
            self._give_back(by_slot[released.slot])
        if self.on_step is not None:
            for st in out.steps:
                self.on_step(st.batch_size, st.elapsed_s, st.context_right)

    def _give_back(self, h: LocalStream) -> None:
        with self._lock:
            self._by_slot[h.slot] = None
            del self._by_id[h.stream_id]
            self._num_phrases -= h.num_phrases
            heapq.heappush(self._free, h.slot)
        h.stream = None

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
        return len(self._free)

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
        """Raise AccountingError unless the Engine's books agree (Engine.check_accounting) and
        match the slots allocated here: every stream the Engine holds is on a slot allocated here
        to its id. `exact`: also no open still queued (every slot allocated here is held there).
        Returns the Engine's open streams."""
        rows = self.engine.check_accounting()
        with self._lock:
            allocated = {h.slot: h.stream_id for h in self._by_id.values()}
            free = len(self._free)
        check(len(allocated) + free == self.num_slots, f"{len(allocated)} slots allocated and {free} free of {self.num_slots}")
        for s in self.engine.slots.streams():
            check(allocated.get(s.slot) == s.stream_id, f"the engine holds stream {s.stream_id} on slot {s.slot}, "
                                                         f"allocated here to {allocated.get(s.slot)}")  # fmt: skip
        check(not exact or len(allocated) == rows, f"{len(allocated)} streams admitted, {rows} taken in")
        return rows


def _assembling(on_result: Callable[[StreamResult], None], engine: Engine):
    assemble = ResultAssembler(engine.detok, engine.geometry.encoder_frame_s)
    return lambda update: on_result(assemble(update))
