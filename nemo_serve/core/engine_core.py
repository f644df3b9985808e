"""The engine core: the Engine behind a slot table, its inputs method calls, its outputs returned.

No transport in here: core/core_proc.py drives it over ZMQ and shared memory (the server),
core/inproc.py from this process (tests, --selftest, benchmarks). One class behind both (vLLM's
EngineCore, EngineCoreProc and InprocClient), so both deliver in one order: a released stream's
slot is free in the slot table before its front end sees its last update.

Inputs, from the one thread that steps, between steps (the control messages of core/messages.py
name the same calls; `apply_control` maps one to its call):
  open        a stream on a slot its front end allocated in the slot table, at that generation
  wrote       new ring ends for some slots (their samples are in the rings already); with the
              ring positions in shared memory (shared.py) no wrote comes: step 2 reads them there
  finish / force_final / abort      a stream by (slot, generation); a stale one is ignored
  frontend_gone                     abort its streams, free its slots
`step()`:
  2 audio: the slots whose ring end moved (one array comparison over the slots), copied out of the
    rings into the streams' buffers, with the front end's arrival time
  3 ends of input (after 2, so a stream's last packet is in before its end)
  4 Engine.iterate(), its output routed: updates to their slot's front end, released streams'
    slots freed in the slot table, the queue delay published there
  5 returned: per front end its updates, how far its rings were read (positions in messages; in
    shared memory the read ends are stored there in 2), the slots released
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..engine.endpoint import EndpointConfig
from ..engine.invariants import check
from ..engine.outputs import IterationOutput
from ..engine.results import StreamUpdate
from . import messages as m
from .shared import FREE, SharedLayout, fence, positions_in_shared_default

log = logging.getLogger("nemo_serve.core")

_NO_SLOTS = np.zeros(0, dtype=np.int64)


@dataclass
class FrontendResults:
    """What one step has for one front end."""

    updates: list[StreamUpdate] = field(default_factory=list)  # in the order produced
    read_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)  # rings read in this step: the space before read_ends is free
    read_gens: np.ndarray = field(default_factory=lambda: _NO_SLOTS)
    read_ends: np.ndarray = field(default_factory=lambda: _NO_SLOTS)
    released: list[tuple[int, int]] = field(default_factory=list)  # (slot, gen) freed in the slot table


@dataclass(frozen=True)
class CoreStep:
    engine: IterationOutput  # what Engine.iterate() returned (steps, busy, ...)
    results: dict[int, FrontendResults]  # front end -> its news; front ends without news are absent

    @property
    def busy(self) -> bool:
        return self.engine.busy


class EngineCore:
    """The Engine and the slot table (core/shared.py SharedSlots, or core/inproc.py LocalSlots)."""

    def __init__(self, engine, slots) -> None:
        if engine.num_slots != slots.num_slots:  # one slot table: a front end's slot is the cache row
            raise ValueError(f"the engine has {engine.num_slots} slots, the slot table {slots.num_slots}")
        self.engine = engine
        self.shared = slots
        # Which stream holds a slot is the engine's slot table (engine.slots), nowhere here. The
        # core's own per-slot facts: the generation and front end of the stream it opened there,
        # and the ring positions (shared.py: they travel in messages).
        n = slots.num_slots
        self._gen = np.zeros(n, dtype=np.int64)
        self._frontend_of = np.full(n, -1, dtype=np.int64)
        self._write_end = np.zeros(n, dtype=np.int64)  # samples the front end says it wrote
        self._read_end = np.zeros(n, dtype=np.int64)  # samples copied out of the ring
        self._arrival = np.zeros(n, dtype=np.float64)  # when the newest written ones arrived
        self._forced = np.zeros(n, dtype=np.int64)  # positional ForceFinals received (shared.py: `forced`)
        # Ring positions in shared memory (shared.py): the write ends are read from there when the
        # core plans, the read ends stored there, and no read ends travel in Results.
        self.positions_in_shared = slots.layout.positions_in_shared
        self.last_audio_s = time.monotonic()  # when the core last found new audio in a ring
        self._read_slots: list[np.ndarray] = []  # slots read since the last step returned
        self._finishes: list = []  # streams whose end of input arrived since the last step
        self._outgoing: dict[int, FrontendResults] = defaultdict(FrontendResults)
        self.frontends: set[int] = set()  # front ends that opened a stream and are not gone
        self._gone: set[int] = set()

    # ------------------------------------------------------------------ 1 inputs
    def open(self, *, frontend: int, slot: int, gen: int, stream_id: str, language_index: int = 0,
             endpoint: dict | None = None, context_right: int | None = None, phrases: list[str] | None = None,
             boost: float | None = None, diarization: dict | None = None) -> None:  # fmt: skip
        """A stream on `slot`, allocated by `frontend` at generation `gen`. A refusal (a sane front
        end: only the server-wide phrase total) is an error update to the front end, slot freed.
        `endpoint`: EndpointConfig's fields; empty or None: the engine's own rules."""
        if frontend in self._gone:  # sent just before its front end died
            self._free_if_held(slot, gen)
            return
        try:
            self.engine.admit(slot=slot, stream_id=stream_id, language_index=language_index,
                              endpoint=EndpointConfig(**endpoint) if endpoint else None, context_right=context_right,
                              phrases=phrases, boost=boost, diarization=diarization)  # fmt: skip
        except (RuntimeError, ValueError, TypeError) as e:
            log.error("open refused for slot %d: %s", slot, e)
            self._outgoing[frontend].updates.append(StreamUpdate(stream_id, 0, True, True, [], [], 0, 0.0, time.time(),
                                                                 error=str(e)))  # fmt: skip
            self._free_if_held(slot, gen)
            return
        self._gen[slot], self._frontend_of[slot] = gen, frontend
        self._write_end[slot] = self._read_end[slot] = self._forced[slot] = 0
        self.frontends.add(frontend)

    def wrote(self, slots: np.ndarray, gens: np.ndarray, ends: np.ndarray, arrivals: np.ndarray) -> None:
        """A front end's new ring ends; called after it wrote the samples (shared.py)."""
        if not len(slots) == len(gens) == len(ends) == len(arrivals) or not np.all((slots >= 0) & (slots < len(self._gen))):
            log.error("malformed Wrote dropped (%d slots)", len(slots))
            return
        # A stream that ended meanwhile (its slot closed, or reused: another generation) is skipped.
        live = self.engine.slots.held[slots] & (self._gen[slots] == gens)
        slots = slots[live]
        self._write_end[slots] = ends[live]
        self._arrival[slots] = arrivals[live]

    def finish(self, slot: int, gen: int) -> None:
        if (stream := self._stream_at(slot, gen)) is not None:
            self._finishes.append(stream)  # applied in step, after the audio that came before it

    def force_final(self, slot: int, gen: int, at_sample: int | None = None) -> None:
        if (stream := self._stream_at(slot, gen)) is not None:
            self._forced[slot] += at_sample is not None
            self.engine.force_final(stream, at_sample)

    def abort(self, slot: int, gen: int, reason: str = "aborted") -> None:
        if (stream := self._stream_at(slot, gen)) is not None:
            self.engine.abort(stream, reason)

    def frontend_gone(self, frontend: int) -> None:
        self._gone.add(frontend)
        self.frontends.discard(frontend)
        served = self.engine.slots.held & (self._frontend_of == frontend)
        for slot in np.flatnonzero(served).tolist():
            self.engine.abort(self.engine.slots.stream_at(slot), "front end died")
        owned = np.flatnonzero(self.shared.owner == frontend)
        orphans = [int(s) for s in owned if not served[s]]  # allocated, never opened
        if orphans:
            self.shared.free(orphans)
        self._outgoing.pop(frontend, None)
        log.warning("front end %d gone: %d streams aborted, %d slots freed", frontend, int(served.sum()), len(orphans))

    def _free_if_held(self, slot: int, gen: int) -> None:
        with self.shared.lock:
            if self.shared.gen[slot] == gen and self.shared.owner[slot] != FREE:
                self.shared.owner[slot] = FREE

    def _stream_at(self, slot: int, gen: int):
        """The stream this core opened on `slot` at generation `gen`, if it is still open."""
        if not 0 <= slot < len(self._gen) or self._gen[slot] != gen:
            return None
        return self.engine.slots.stream_at(slot)

    # ------------------------------------------------------------------ 2-3 audio, ends of input
    def take_input(self) -> None:
        """Steps 2 and 3 alone (step() starts with them; tests call it before Engine.plan())."""
        self._take_audio()
        for stream in self._finishes:
            self.engine.finish(stream)
        self._finishes.clear()

    def audio_waiting(self) -> bool:
        """Shared positions: whether a held slot's ring has samples the core has not copied out
        (the core's look before it sleeps: shared.py, the wake-up)."""
        active = np.flatnonzero(self.engine.slots.held)
        ends = self.shared.written(active, self._gen[active], self._read_end[active])
        return bool((ends != self._read_end[active]).any())

    def _take_audio(self) -> None:
        active = np.flatnonzero(self.engine.slots.held)
        if active.size == 0:
            return
        if self.positions_in_shared:
            ends = self.shared.written(active, self._gen[active], self._write_end[active])
            self._arrival[active] = self.shared.arrival[active]
            fence()  # the positions before the samples they cover, and before the forced counts
            # A positional ForceFinal still in transit: that slot's audio waits for it (shared.py).
            waiting = self.shared.forced_sent(active, self._gen[active]) > self._forced[active]
            self._write_end[active] = np.where(waiting, self._write_end[active], ends)
        ends = self._write_end[active]
        moved = ends != self._read_end[active]
        slots, ends = active[moved], ends[moved]
        if slots.size == 0:
            return
        views = self.shared.views
        starts = self._read_end[slots].tolist()
        parts = [views(slot, start, end) for slot, start, end in zip(slots.tolist(), starts, ends.tolist())]
        # One copy, ring -> each stream's buffer; the front end learns in step 5 that the space is free.
        self.engine.take_audio_many(slots, parts, self._arrival[slots].tolist())
        self._read_end[slots] = ends
        self.last_audio_s = time.monotonic()
        if self.positions_in_shared:
            fence()  # the copies out before the space is given back
            self.shared.read_end[slots] = ends
        else:
            self._read_slots.append(slots)

    # ------------------------------------------------------------------ 4-5 step
    def step(self) -> CoreStep:
        self.take_input()
        # While the engine steps, the figure the front ends read must stand however long the step
        # takes (a step longer than the window is not an idle engine: queue_delay.py), so its
        # validity is open-ended until the engine returns the pair as its steps left it.
        queue_delay = self.shared.queue_delay
        queue_delay[:] = (self.shared.queue_delay_s(time.time()), math.inf)
        out = self.engine.iterate()
        queue_delay[:] = out.queue_delay
        if out.updates:
            self._route(out.updates, self._frontend_of[np.array(out.update_slots, dtype=np.int64)])
        if out.released:  # the engine gave these slots back: free them before anyone hears of it
            slots = [r.slot for r in out.released]
            self.shared.free(slots)
            for slot in slots:
                self._outgoing[int(self._frontend_of[slot])].released.append((slot, int(self._gen[slot])))
        return CoreStep(out, self._take_results())

    def _route(self, updates: tuple, frontends: np.ndarray) -> None:
        """Each update to its front end's list, in order: one list slice when they all go to one
        front end (the usual case), else picked with one mask each."""
        outgoing = self._outgoing
        if (frontends == frontends[0]).all():
            outgoing[int(frontends[0])].updates.extend(updates)
            return
        for frontend in np.unique(frontends).tolist():
            outgoing[frontend].updates.extend(updates[i] for i in np.flatnonzero(frontends == frontend).tolist())

    def _take_results(self) -> dict[int, FrontendResults]:
        read = self._read_slots[0] if len(self._read_slots) == 1 else np.concatenate(self._read_slots or [_NO_SLOTS])
        self._read_slots.clear()
        read_by = self._frontend_of[read]
        for frontend in np.unique(read_by).tolist() if read.size else ():
            slots = read[read_by == frontend]
            r = self._outgoing[frontend]
            r.read_slots, r.read_gens, r.read_ends = slots, self._gen[slots], self._read_end[slots]
        results = {f: r for f, r in self._outgoing.items() if f not in self._gone}
        self._outgoing = defaultdict(FrontendResults)
        return results

    # ------------------------------------------------------------------ books
    def check_invariants(self) -> int:
        """Raise AccountingError unless the engine's books agree (Engine.check_accounting) and
        match the slot table: every slot the engine holds a stream on is owned there by the front
        end that opened the stream, at its generation. Front ends only ever take free slots, and
        only this thread frees them, so the slots checked here cannot change under it. Returns
        the streams holding a cache row. Between steps."""
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


def apply_control(core: EngineCore, msg) -> None:
    """One control message (core/messages.py) as the core call it names; both transports use it.
    A Wake names none: it only ended the core's wait."""
    if isinstance(msg, m.Wrote):
        core.wrote(np.frombuffer(msg.slots, m.SLOT), np.frombuffer(msg.gens, m.GEN), np.frombuffer(msg.ends, m.POS),
                   np.frombuffer(msg.arrivals, m.TIME))  # fmt: skip
    elif isinstance(msg, m.Open):
        core.open(frontend=msg.frontend, slot=msg.slot, gen=msg.gen, stream_id=msg.stream_id,
                  language_index=msg.language_index, endpoint=msg.endpoint, context_right=msg.context_right,
                  phrases=msg.phrases, boost=msg.boost, diarization=msg.diarization)  # fmt: skip
    elif isinstance(msg, m.Finish):
        core.finish(msg.slot, msg.gen)
    elif isinstance(msg, m.ForceFinal):
        core.force_final(msg.slot, msg.gen, msg.at_sample)
    elif isinstance(msg, m.Abort):
        core.abort(msg.slot, msg.gen, msg.reason)
    elif isinstance(msg, m.FrontendGone):
        core.frontend_gone(msg.frontend)


def ring_layout(settings, sample_rate: int) -> SharedLayout:
    return SharedLayout(settings.num_slots, int(settings.audio_ring_s * sample_rate), positions_in_shared_default())
