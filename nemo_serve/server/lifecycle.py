"""A WebSocket session's lifecycle (session.Session: /v1/realtime). It says two things:
how its engine streams abort, and what item in its outbox ends it (an error frame and a close).
/ws, Riva gRPC and the file API run on stream_session.StreamSession, where realtime goes next.

  admit          ServerContext.admit (the one admission), then the stream counted open in its mode
  fail           once: abort the engine streams, count and log the reason, put the ending item
                 first in the outbox (results still waiting are dropped)
  engine_callback  an engine result handed over to the event loop, where an engine error fails the
                 session and anything after a failure is dropped
  settle         the transport's `finally:`: the open-stream gauge back down, once

File transcription (file_transcription.py) is not one: an HTTP request has no outbox, its failure
is the request's answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..engine.results import StreamResult
from .context import ServerContext
from .handover import hand_over
from .logsafe import clean
from .outbox import Outbox
from .protocol import CLOSE_GOING_AWAY, CLOSE_PROTOCOL_ERROR, CLOSE_SERVER_ERROR, MAX_REASON_CHARS

# A failure's close code by its label, where the caller gives none; the rest: 1008.
_CLOSE_FOR_LABEL = {"drain_timeout": CLOSE_GOING_AWAY, "engine": CLOSE_SERVER_ERROR}


class StreamLifecycle:
    def __init__(self, ctx: ServerContext, name: str, log: logging.Logger) -> None:
        self.ctx = ctx
        self.name = name  # "ws3", "riva7": in logs
        self.log = log  # the transport's logger
        self.outbox = Outbox()  # results and messages to send, then the transport's ending item
        self.mode_label = str(ctx.model.geometry.context_right)  # the stream's chunk mode, for metrics
        self.closing = False  # failed: the ending item is queued, everything else is ignored
        self.client_gone = False  # the peer left (or was dropped): nothing can be sent any more
        self.admitted = False  # counted open in the metrics; settle() counts it closed
        self.opened_at = 0.0  # the duration clock, from admission
        self._loop = asyncio.get_running_loop()
        self._progress = asyncio.Event()  # set when the model consumed more audio, or the session ends

    # ------------------------------------------------------------------ what a transport says
    def abort_streams(self, reason: str) -> None:
        """Abort every engine stream of this session (idempotent)."""
        raise NotImplementedError

    def ending_item(self, reason: str, code: Any) -> object:
        """The outbox item that ends the transport after a failure with `code`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lifecycle
    def admit(self, on_result: Callable | None, context_right: int | None, **stream_options):
        """ServerContext.admit; raises its Refused, or ValueError for options the engine does not
        serve. Admitted: the stream counts as open in its mode from now."""
        handle = self.ctx.admit(on_result, context_right=context_right, **stream_options)
        self.opened_at = time.monotonic()
        self.admitted = True
        self.mode_label = str(self.ctx.model.geometry_for(context_right).context_right)
        self.ctx.metrics.stream_opened(self.mode_label)
        return handle

    def fail(self, reason: str, code: Any = None, reason_label: str = "protocol") -> None:
        """Abort the engine streams (their slots come back between steps), tell the peer why and
        end. Idempotent. `code`: a WebSocket close code; None: the one for `reason_label`
        (ServerContext's drain and watchdog give only the label)."""
        if self.closing or self.client_gone:
            return
        if code is None:
            code = _CLOSE_FOR_LABEL.get(reason_label, CLOSE_PROTOCOL_ERROR)
        self.closing = True
        self._progress.set()
        self.abort_streams(reason)
        self.ctx.metrics.stream_errors.labels(reason=reason_label).inc()
        reason = clean(reason, MAX_REASON_CHARS)
        self.log.info("%s error (%s): %s", self.name, reason_label, reason)
        self.outbox.put_first(self.ending_item(reason, code))

    def engine_callback(self, take: Callable[[StreamResult], None]) -> Callable[[StreamResult], None]:
        """An engine result callback: it hands the result over to the event loop and returns at
        once (the in-process engine calls from its loop thread); there `take` gets it, unless the
        session is ending or it is an error, which fails the session."""

        def on_result(result: StreamResult) -> None:
            hand_over(self._loop, self._take, take, result)

        return on_result

    def _take(self, take: Callable[[StreamResult], None], r: StreamResult) -> None:
        if self.closing or self.client_gone:
            return
        if r.error is not None:
            self.fail(f"engine error: {r.error}", CLOSE_SERVER_ERROR, "engine")
            return
        take(r)

    def settle(self) -> None:
        """Whatever ended the session: the stream no longer counts as open (once)."""
        if self.admitted:
            self.admitted = False
            self.ctx.metrics.stream_closed(self.mode_label)
