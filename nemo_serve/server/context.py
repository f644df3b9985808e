"""What every socket shares: the engine, the settings, the metrics, the set of open sessions.

Owner: the event loop. Sessions add and remove themselves; drain and the engine watchdog walk
the set. Nothing here is touched by another thread.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from ..config import Settings
from ..engine.errors import NoFreeSlotError
from ..admission import Verdict
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from ..engine_api import EngineAPI

log = logging.getLogger("nemo_serve.server")

DRAIN_CLOSE_GRACE_S = 1.0  # after the drain deadline: time for the error and close 1012 frames


class Refused(Exception):
    """A stream not admitted: `label` for the metric, `reason` for the client (counted already)."""

    def __init__(self, label: str, reason: str) -> None:
        super().__init__(reason)
        self.label, self.reason = label, reason


class Session(Protocol):
    """What the context asks of an open session (stream_session.StreamSession; for a realtime
    socket its subclass realtime_session.RealtimeSession, whose items are not in the set): named
    here, so that the context need not import the sessions, which import it. A failure is a reason and its label; each adapter says it in its
    protocol's terms (a close code, a gRPC status, an HTTP status)."""

    def drain(self) -> None: ...

    def fail(self, reason: str, *, reason_label: str) -> None: ...

    def drop(self) -> None: ...


@dataclass
class ServerContext:
    engine: "EngineAPI"  # the engine cores (engine_api.py; in tests, the in-process engine)
    settings: Settings
    metrics: ServerMetrics
    sessions: set["Session"] = field(default_factory=set)  # accepted sockets not yet closed
    draining: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def model(self):
        """ModelInfo: what the network side knows of the model (no torch)."""
        return self.engine.model_info

    @property
    def engine_alive(self) -> bool:
        return self.engine.error is None

    def admit(self, on_result: Callable | None = None, **stream_options):
        """The one admission call of every protocol: judge the load, then take a slot with
        `engine.open_stream(on_result, **stream_options)` and return the engine's handle. Without
        `on_result` it only checks (a handshake, an upload not yet read: their slots are taken
        later) and returns None. Raises Refused, counted in the refusal metric, or the engine's
        ValueError for options it does not serve (a bad config: not a refusal).

        The overload guard moves once per stream (admission.py: its cap is set from the decisions
        it sees): where the slot is taken, or where the stream is refused, whichever comes first.
        A check that admits reads only; rejected: deciding at the check and again at the slot,
        which counted every /ws stream twice and moved the guard for streams that never came."""
        taking = on_result is not None
        refusal = self._judge(lambda: self.engine.overload(decide=taking).refusal)
        if refusal is not None and refusal[0] == "overloaded" and not taking:
            self.engine.overload(decide=True)  # a check that refuses: this stream's one decision
        if refusal is None and taking:
            try:
                return self.engine.open_stream(on_result, **stream_options)
            except NoFreeSlotError as e:  # lost the race for the last slot since the check
                refusal = "no_free_slot", f"no free slot ({e}); retry later"
        if refusal is not None:
            self.metrics.refusals.labels(reason=refusal[0]).inc()
            raise Refused(*refusal)
        return None

    def refusal(self) -> tuple[str, str] | None:
        """(metric label, reason for the client) for a stream whose slot is being taken or refused
        now, else None. Moves the engine's overload guards (admission.py: one per engine core,
        shared by every front end); /readyz asks `readiness()`, a check `admit()`."""
        return self._judge(lambda: self.engine.overload(decide=True).refusal)

    def readiness(self, now: float | None = None) -> tuple[tuple[str, str] | None, Verdict]:
        """What `refusal()` would answer at `now` (default: the clock), and the overload verdict;
        reads only."""
        verdict = self.engine.overload(now=now)
        return self._judge(lambda: verdict.refusal), verdict

    @property
    def overloaded(self) -> bool:
        """The engine is behind real time, or recovering from it (admission.py); reads only."""
        return self.engine.overload().overloaded

    def _judge(self, overload_refusal: Callable[[], str | None]) -> tuple[str, str] | None:
        if self.draining:
            return "draining", "server is draining (shutting down); retry another instance"
        if not self.engine_alive:
            return "engine_failed", "engine failed; see /healthz"
        if self.engine.num_free_slots <= 0:
            return "no_free_slot", f"no free slot (all {self.engine.num_slots} in use); retry later"
        reason = overload_refusal()
        return None if reason is None else ("overloaded", reason)

    def add(self, session: "Session") -> None:
        self.sessions.add(session)
        self._idle.clear()

    def remove(self, session: "Session") -> None:
        self.sessions.discard(session)
        if not self.sessions:
            self._idle.set()

    async def drain(self) -> None:
        """Stop admitting; end every open stream's input so it gets its final; wait, bounded."""
        self.draining = True
        self.metrics.draining.set(1)
        log.info("draining: %d open sessions, up to %.0f s", len(self.sessions), self.settings.drain_timeout_s)
        for s in list(self.sessions):
            s.drain()
        await self._wait_idle(self.settings.drain_timeout_s)
        for s in list(self.sessions):
            s.fail("server shut down before the stream finished (drain timeout)", reason_label="drain_timeout")
        # Let the send tasks put their error and close frames on the wire before uvicorn tears
        # down; a client that does not read cannot take them, and is dropped, so that it cannot
        # hold the exit past the drain deadline (uvicorn would wait for its buffer to empty).
        await self._wait_idle(DRAIN_CLOSE_GRACE_S)
        for s in list(self.sessions):
            s.drop()
        await self._wait_idle(DRAIN_CLOSE_GRACE_S)
        log.info("drained")

    async def _wait_idle(self, timeout_s: float) -> None:
        if self.sessions:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass

    async def watch_engine(self, period_s: float = 0.5) -> None:
        """If the engine fails (no engine core left), every open stream gets an error instead of
        hanging forever."""
        while self.engine_alive:
            await asyncio.sleep(period_s)
        log.error("engine failed: %r; failing %d open streams", self.engine.error, len(self.sessions))
        for s in list(self.sessions):
            s.fail(f"engine failed: {type(self.engine.error).__name__}", reason_label="engine")
