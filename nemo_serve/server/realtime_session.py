"""A /v1/realtime socket's StreamSession: a session whose engine streams are its items.

Everything a stream's lifecycle is stays StreamSession's, once for every protocol: the outbox,
the failure, the send deadline, drain and drop, the idle and duration clocks, backpressure, the
open-stream metric and the ServerContext's session set. What differs is where the engine
streams are: the item manager (realtime.py) holds one StreamSession per item that has a slot,
and this session speaks for all of them:

  open         admission at the first append (ServerContext.admit without a slot: the items
               take theirs), counted open once, the duration clock started
  end_input    the item manager finishes the current item; the last one closes the socket
  abort        every item's engine stream (a failure, a drop, the client gone, the `finally:`)
  behind_s     the audio of the items not yet done (audio waiting for a slot counts)
  the clocks   the item manager's rules first: committed items decoding stop the idle clock,
               and an item whose audio stopped is finished before any idle close
"""

from __future__ import annotations

import time
from typing import Protocol

from .context import Refused
from .stream_session import StreamSession


class Items(Protocol):
    """What the session asks of its item manager (realtime.RealtimeFormat)."""

    def end_input(self) -> None: ...

    def abort(self, reason: str) -> None: ...

    def behind_s(self) -> float: ...

    def reading_resumed(self) -> None: ...

    def idle_deadline(self, idle_deadline: float, last_input: float) -> float: ...

    def deadline_passed(self, now: float) -> bool: ...


class RealtimeSession(StreamSession):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.items: Items | None = None  # set by the item manager that made this session
        self.opened = False  # admitted (the first append or done): streaming from here

    @property
    def streaming(self) -> bool:
        return self.opened and not self.input_ended and not self.closing

    def open(self, context_right: int | None = None, **_) -> bool:
        """Admit the socket's stream without a slot (each item takes its own); False when refused."""
        try:
            self.ctx.admit(None, context_right=context_right)
        except Refused as e:
            self.fail(e.reason, "refused", refusal=e.label)
            return False
        self.opened = True
        self.opened_at = time.monotonic()
        self.admitted = True
        self.mode_label = str(self.ctx.model.geometry_for(context_right).context_right)
        self.ctx.metrics.stream_opened(self.mode_label)
        return True

    def end_input(self, reason: str = "end") -> None:
        if not self.streaming:
            return
        self.input_ended, self.end_reason = True, reason
        self.items.end_input()
        self._progress.set()

    def drain(self) -> None:
        if not self.opened:
            self.fail("server is draining (shutting down)", "draining")
            return
        try:
            self.end_input("draining")
        except ValueError as e:  # the session's WAV header was cut short
            self.fail(str(e), "bad_audio")

    def _abort(self, reason: str) -> None:
        if self.items is not None:
            self.items.abort(reason)

    def item_progressed(self) -> None:
        """An item's result counted (StreamSession.progressed): backpressure looks again."""
        self._progress.set()

    @property
    def behind_s(self) -> float:
        return self.items.behind_s()

    async def wait_for_model(self) -> None:
        waited = self.model_behind()
        await super().wait_for_model()
        if waited:
            self.items.reading_resumed()

    def input_deadline(self) -> float | None:
        """StreamSession's, with the item manager's rules for the idle clock while streaming."""
        if not self.streaming:
            return super().input_deadline()
        s = self.ctx.settings
        idle = self.items.idle_deadline(self.last_input + s.idle_timeout_s, self.last_input)
        return min(idle, self.opened_at + s.max_stream_s)

    def input_deadline_passed(self) -> None:
        """The item manager acts first (an item finished, or the idle clock held while items
        decode); else StreamSession's rules, where one of its clocks really ran out."""
        now, s = time.monotonic(), self.ctx.settings
        if self.streaming and now < self.opened_at + s.max_stream_s and self.items.deadline_passed(now):
            return
        if now >= super().input_deadline():
            super().input_deadline_passed()
