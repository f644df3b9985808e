"""One uploaded file through the engine as one stream: all of its audio pushed at once, then end
of input, then the finals collected. No real-time pacing: the engine steps the stream's chunks as
fast as its steps come round (a stream that sent a minute at once is not counted as the engine
falling behind, engine/queue_delay.py), under the same slots and admission as a /ws stream.

It joins the server's set of open sessions (context.py) for the same lifecycle as a socket: a
drain lets it finish (its input has already ended), the drain deadline or a dead engine fails it,
and `finally:` aborts its stream however the request ends, so a slot is never leaked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from ..engine.results import StreamResult
from .context import Refused, ServerContext
from .handover import hand_over

log = logging.getLogger("nemo_serve.transcriptions")


class TranscriptionFailed(Exception):
    """The stream could not finish: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str, label: str) -> None:
        super().__init__(reason)
        self.status, self.reason, self.label = status, reason, label


class FileTranscription:
    def __init__(self, ctx: ServerContext, language: str | None, context_right: int | None) -> None:
        self.ctx = ctx
        self.language = language
        self.context_right = context_right
        self.mode_label = str(ctx.model.geometry_for(context_right).context_right)
        self.stream = None  # the engine's handle once admitted
        self.finals: list[StreamResult] = []  # in segment order
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future = self._loop.create_future()  # set after the last result
        self._audio_processed_s = 0.0

    async def run(self, samples: np.ndarray, timeout_s: float, receive: Callable[[], Awaitable[dict]]) -> list[StreamResult]:
        """The stream's finals, or TranscriptionFailed (refused, engine error, drain, timeout, the
        client gone). `receive`: the request's ASGI receive, read to its end already; its next
        message is the client's disconnect, which stops the decoding at once (rejected: decoding
        on for nobody, up to a minute for an hour of audio)."""
        self._open()
        self.ctx.add(self)
        gone = asyncio.create_task(_disconnect(receive), name="file-client-watch")
        try:
            self.ctx.metrics.stream_opened(self.mode_label)
            try:
                self.ctx.engine.push(self.stream, samples)
                self.ctx.engine.finish(self.stream)
                finished, _ = await asyncio.wait({self._done, gone}, timeout=timeout_s,
                                                 return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            finally:
                self.ctx.metrics.stream_closed(self.mode_label)
            if self._done in finished:
                self._done.result()  # TranscriptionFailed, if it failed
            elif gone in finished:
                self.ctx.metrics.stream_errors.labels(reason="client_gone").inc()
                raise TranscriptionFailed(499, "the client closed the connection", "client_gone")
            else:
                self.ctx.metrics.stream_errors.labels(reason="timeout").inc()
                raise TranscriptionFailed(503, f"transcription did not finish within {timeout_s:.0f} s "
                                          "(server overloaded)", "timeout")  # fmt: skip
        finally:
            gone.cancel()
            self.ctx.engine.abort(self.stream, "request ended")  # idempotent; a no-op once done
            self.ctx.remove(self)
        return self.finals

    def _open(self) -> None:
        """Take a slot, or raise TranscriptionFailed(503) with /ws's reasons."""
        try:
            self.stream = self.ctx.admit(self._on_result, language=self.language, context_right=self.context_right)
        except Refused as e:
            raise TranscriptionFailed(503, e.reason, "refused") from None

    # ------------------------------------------------------------------ engine side
    def _on_result(self, result: StreamResult) -> None:
        """Engine callback (loop thread, or the front end's event loop): hand over at once."""
        hand_over(self._loop, self._take_result, result)

    def _take_result(self, r: StreamResult) -> None:
        if self._done.done():
            return
        if r.error is not None:
            self.fail(f"engine error: {r.error}", reason_label="engine")
            return
        m = self.ctx.metrics
        m.audio_seconds.inc(max(0.0, r.audio_processed_s - self._audio_processed_s))
        self._audio_processed_s = max(self._audio_processed_s, r.audio_processed_s)
        if r.is_final:
            self.finals.append(r)
            m.result_sent(True, self.mode_label, max(0.0, time.time() - r.audio_arrival_time))
        if r.done:
            self._done.set_result(None)

    # ------------------------------------------------------------------ what context.py calls
    def drain(self) -> None:
        """Server shutdown: input has already ended; the finals come out as usual."""

    def fail(self, reason: str, code: int = 0, reason_label: str = "internal") -> None:
        """The engine died or the drain deadline passed: the request answers 503 (500 for an
        engine error). `code` is a WebSocket close code, meaningless here."""
        if self._done.done():
            return
        self.ctx.metrics.stream_errors.labels(reason=reason_label).inc()
        log.info("file transcription failed (%s): %s", reason_label, reason)
        status = 500 if reason_label == "engine" and "engine error" in reason else 503
        self._done.set_exception(TranscriptionFailed(status, reason, reason_label))

    def drop(self) -> None:
        self.fail("server shut down before the transcription finished", reason_label="drain_timeout")


async def _disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has gone (the body was read: nothing else can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass
