"""One uploaded file through the engine as one stream: all of its audio pushed at once, then end
of input, then the finals collected. No real-time pacing: the engine steps the stream's chunks as
fast as its steps come round (a stream that sent a minute at once is not counted as the engine
falling behind, engine/queue_delay.py), under the same slots and admission as a /ws stream.

A StreamSession (stream_session.py), in the server's set of open sessions (context.py) as a
socket's is: a drain lets it finish (its input has already ended), the drain deadline or a dead
engine fails it, and `finally:` aborts its stream however the request ends, so a slot is never
leaked. Here are only the HTTP terms: the request's deadline, its client leaving, the status.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from collections.abc import Awaitable, Callable

import numpy as np

from ..engine.results import StreamResult
from .context import ServerContext
from .stream_session import Failure, StreamSession

log = logging.getLogger("nemo_serve.transcriptions")
_numbers = itertools.count(1)


class TranscriptionFailed(Exception):
    """The stream could not finish: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str, label: str) -> None:
        super().__init__(reason)
        self.status, self.reason, self.label = status, reason, label


def http_status(f: Failure) -> int:
    """A failure in HTTP's terms: an engine error on this stream 500, options the engine does not
    serve 400, the client gone 499 (nginx's), the rest (refused, engine failed, drain, timeout) 503."""
    if f.label == "engine" and "engine error" in f.reason:
        return 500
    return {"bad_config": 400, "client_gone": 499}.get(f.label, 503)


class FileTranscription:
    def __init__(self, ctx: ServerContext, language: str | None, context_right: int | None,
                 diarization: dict | None = None, phrases: list[str] | None = None,
                 boost: float | None = None) -> None:  # fmt: skip
        self.ctx = ctx
        self.phrases = {"phrases": phrases, "boost": boost} if phrases else {}  # boosting, checked at open
        self.diarization = diarization  # the engine's option (engine/speakers.py); None: no speakers
        self.language = language
        self.context_right = context_right
        # Finals only, taken as they come: a long file's many finals are not a client that stops reading.
        self.session = StreamSession(ctx, f"file{next(_numbers)}", log, max_queued=sys.maxsize)
        self.finals: list[StreamResult] = []  # in segment order

    async def run(self, samples: np.ndarray, timeout_s: float, receive: Callable[[], Awaitable[dict]]) -> list[StreamResult]:
        """The stream's finals, or TranscriptionFailed (refused, engine error, drain, timeout, the
        client gone). `receive`: the request's ASGI receive, read to its end already; its next
        message is the client's disconnect, which stops the decoding at once (rejected: decoding
        on for nobody, up to a minute for an hour of audio)."""
        s = self.session
        if not s.open(self.context_right, interim_results=False, language=self.language, diarization=self.diarization,
                      **self.phrases):  # fmt: skip
            raise _failed(s.failure)
        self.ctx.add(s)
        gone = asyncio.create_task(_disconnect(receive), name="file-client-watch")
        collect = asyncio.create_task(self._collect(), name="file-collect")
        try:
            s.push(samples)
            s.end_input()
            finished, _ = await asyncio.wait({collect, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if collect in finished:
                collect.result()  # TranscriptionFailed, if it failed
            else:
                if gone in finished:
                    s.fail("the client closed the connection", "client_gone")
                else:
                    s.fail(f"transcription did not finish within {timeout_s:.0f} s (server overloaded)", "timeout")
                raise _failed(s.failure)
        finally:
            for task in (gone, collect):
                task.cancel()
            s.close("request ended")  # the slot comes back however the request ends
            self.ctx.remove(s)
        return self.finals

    async def _collect(self) -> None:
        """The finals, in order, until `done`; a failure raises TranscriptionFailed."""
        while True:
            event = await self.session.next_event()
            if isinstance(event, Failure):
                raise _failed(event)
            if event.is_final:
                self.finals.append(event)
                self.session.result_sent(event)
            if event.done:
                return


def _failed(f: Failure) -> TranscriptionFailed:
    return TranscriptionFailed(http_status(f), f.reason, f.label)


async def _disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has gone (the body was read: nothing else can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass
