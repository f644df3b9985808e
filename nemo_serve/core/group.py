"""EngineGroup: several engine cores (one per device) behind one front end, as one engine.

Sessions see the EngineClient API (open_stream, push, finish, force_final, abort, free slots,
error). A new stream goes to a live core whose overload guard admits it (admission.py;
each core judges its own delay and open streams, its state shared by every front end), the one
with the most free slots first (every core serves every mode from one slot pool, so free slots
are the measure for any mode); the group refuses for overload only when no live core with a free
slot admits. Its handle remembers the core, and every later call for it goes there. A core that
dies fails only its own streams (each gets an error result); the group stays alive, and admits,
while any core serves. Event loop thread only, as EngineClient.
"""

from __future__ import annotations

import asyncio
import logging

from ..engine.errors import NoFreeSlotError
from ..admission import Verdict
from .client import EngineClient, EngineFailed, StreamHandle

log = logging.getLogger("nemo_serve.frontend")

WATCH_PERIOD_S = 0.5


class EngineGroup:
    def __init__(self, clients: list[EngineClient], endpoints) -> None:
        self.clients = clients
        self.endpoints = endpoints  # core/frontend_process.CoreEndpoint per client: index, device, pid
        self.model_info = clients[0].model_info
        self._failed: set[int] = set()  # cores whose streams were failed
        self._watch: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return all(c.started for c in self.clients)

    def start(self) -> "EngineGroup":
        for c in self.clients:
            c.start()
        self._watch = asyncio.create_task(self._watch_cores(), name="engine-cores-watch")
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for c in self.clients:
            c.stop(timeout_s)

    @property
    def num_slots(self) -> int:
        """The live cores' slots: what can be served now (a dead core's are gone until a restart)."""
        return sum(c.num_slots for c in self._live())

    def _live(self) -> list[EngineClient]:
        return [c for c in self.clients if c.error is None]

    @property
    def error(self) -> BaseException | None:
        """None while any core serves; the server is failed only when none does."""
        if self._live():
            return None
        return EngineFailed(f"all {len(self.clients)} engine cores failed or stopped")

    async def _watch_cores(self) -> None:
        while True:
            for i, c in enumerate(self.clients):
                if i not in self._failed and c.error is not None and self._live():
                    self._failed.add(i)
                    n = c.fail_streams(f"engine core {i} failed")
                    log.error("engine core %d on %s failed: %d of its streams got an error; %d core(s) serve on",
                              i, self.endpoints[i].device, n, len(self._live()))  # fmt: skip
            await asyncio.sleep(WATCH_PERIOD_S)

    # ------------------------------------------------------------------ network-side API
    def open_stream(self, on_result, **kw) -> StreamHandle:
        """On a live core whose guard admits a new stream, the most free slots first; on any with a
        free slot when none admits (a stream the guard does not judge: a realtime session's next
        item, admitted with its session); NoFreeSlotError if none has one.

        The counts are a snapshot: another front end can take a core's last slot between this read
        and the allocation, so a core that refuses is followed by the next one with a free slot (a
        stream was refused while the other core had room, with two front ends at four slots)."""
        live = self._live()
        if not live:
            raise NoFreeSlotError("no engine core is serving")
        # admitting cores first, then most free slots; ties: the first core (sorted is stable)
        with_room = sorted((c for c in live if c.num_free_slots > 0),
                           key=lambda c: (c.overload().refusal is not None, -c.num_free_slots))  # fmt: skip
        for core in with_room:
            try:
                h = core.open_stream(on_result, **kw)
            except NoFreeSlotError:
                continue
            h.engine = core
            return h
        raise NoFreeSlotError(f"all {self.num_slots} slots of {len(live)} engine cores are in use")

    def overload(self, decide: bool = False, now: float | None = None) -> Verdict:
        """Whether a new stream is refused for overload: only when no live core with a free slot
        admits it (a full server is refused for its slots, not here). `decide`: the cores are asked
        in open_stream's order, most free slots first, each deciding under its lock until one
        admits; the rest are only read. The verdict's cap: the sum of the cores' (a core without
        one counts its slots), None when no core has one; per core: `cores()`."""
        ranked = sorted(((c.num_free_slots, c) for c in self._live()), key=lambda fc: -fc[0])  # open_stream's order
        refusal, admitted, verdicts = None, False, []
        for free, core in ranked:
            asked = free > 0 and not admitted  # a core that would take the stream now
            v = core.overload(decide and asked, now)
            verdicts.append(v)
            if asked:
                admitted, refusal = v.refusal is None, refusal or v.refusal
        caps = [(v.cap, core.num_slots) for v, (_, core) in zip(verdicts, ranked)]
        cap = None if all(c is None for c, _ in caps) else sum(n if c is None else c for c, n in caps)
        return Verdict(None if admitted else refusal, any(v.behind for v in verdicts), cap)

    def push(self, h: StreamHandle, samples, arrived: float | None = None) -> None:
        h.engine.push(h, samples, arrived)

    def finish(self, h: StreamHandle) -> None:
        h.engine.finish(h)

    def force_final(self, h: StreamHandle, at_sample: int | None = None) -> None:
        h.engine.force_final(h, at_sample)

    def abort(self, h: StreamHandle, reason: str = "aborted") -> None:
        h.engine.abort(h, reason)

    @property
    def num_free_slots(self) -> int:
        return sum(c.num_free_slots for c in self._live())

    @property
    def num_open_streams(self) -> int:
        return sum(c.num_open_streams for c in self._live())

    @property
    def queue_delay_s(self) -> float:
        """Where a new stream would go: the least delay among the live cores with a free slot."""
        live = self._live()
        open_ = [c for c in live if c.num_free_slots > 0] or live
        return min((c.queue_delay_s for c in open_), default=0.0)

    def open_by_mode(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for c in self._live():
            for mode, n in c.open_by_mode().items():
                out[mode] = out.get(mode, 0) + n
        return dict(sorted(out.items()))

    def cores(self, now: float | None = None) -> list[dict]:
        """Each core as /readyz and /metrics show it."""
        return [
            {"core": e.index, "device": e.device, "pid": e.pid, "serving": c.error is None,
             "free_slots": c.num_free_slots if c.error is None else 0, "total_slots": c.num_slots,
             "open_streams": c.num_open_streams if c.error is None else 0,
             "queue_delay_s": round(c.queue_delay_s, 3) if c.error is None else 0.0,
             "recovering_cap": c.overload(now=now).cap if c.error is None else None}
            for c, e in zip(self.clients, self.endpoints)
        ]  # fmt: skip
