"""One streaming session, whatever carries it: a WebSocket, a Riva gRPC call, an HTTP file upload;
on /v1/realtime one per item holding a slot, under the socket's RealtimeSession (realtime_session.py).

  in   open(options)        admission (ServerContext.admit, the only one) and the engine stream
       push(samples)        model-rate audio -> the engine; the input clock and backpressure count it
       force_final()        the segment closes at the audio so far
       end_input(why)       the adapter's tail (flush_input) pushed, then the tail rule (engine.finish)
       close(why)           the adapter's `finally:`: the engine stream aborted, the slot comes back
  out  next_event()         the outbox, in order: the results the client asked for (partials
                            coalesced), the adapter's own messages, and at most one Failure, which
                            jumps the queue; after a `done` result nothing more comes

Inside, once for every protocol: the idle and duration timeouts (`receive`, or `input_deadline`
for an adapter that checks it with a timer of its own), backpressure
(`wait_for_model`: stop reading while the model is MAX_AHEAD_S behind), the send deadline
(`send`: --send-timeout-s), the result intake (engine results handed over to the event loop,
the model's progress counted, an engine error failing the session) and the failure: a Failure
with a metric label and a reason, never a wire code. Each adapter maps a Failure to its own terms
at its edge (a close code, a gRPC status, an HTTP status).

Owner: the event loop. The engine's thread only calls the result callback, which hands over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from ..engine.results import StreamResult
from .context import Refused, ServerContext
from .handover import hand_over
from .logsafe import clean
from .outbox import MAX_QUEUED, Outbox
from .protocol import MAX_REASON_CHARS

# Backpressure: a stream may run this far ahead of the model before its adapter stops reading
# (TCP or HTTP/2 flow control then slows the client). Without it, a client sending an hour of
# audio at full speed would park it all in server memory. Real-time clients are never near it.
MAX_AHEAD_S = 20.0


@dataclass(frozen=True)
class Failure:
    """Why a session ended early. `label`: the stream_errors metric's label and what adapters map
    ("refused", "bad_config", "protocol", "bad_audio", "slow_client", "idle_timeout", "engine",
    "draining", "drain_timeout", "internal", "client_gone"); `refusal`: for "refused", admission's
    own label ("no_free_slot", "overloaded", "draining", "engine_failed")."""

    label: str
    reason: str
    refusal: str | None = None


class StreamSession:
    """One engine stream and its lifecycle (module docstring). `flush_input`: the adapter's
    decoder tail, pushed before the end of input (it may raise ValueError: a truncated header);
    `on_drop`: the adapter's way to cut its transport (the drain's last resort)."""

    def __init__(self, ctx: ServerContext, name: str, log: logging.Logger, *,
                 flush_input: Callable[[], np.ndarray] | None = None, on_drop: Callable[[], None] | None = None,
                 max_queued: int = MAX_QUEUED, results: Callable[[StreamResult], None] | None = None) -> None:  # fmt: skip
        self.ctx = ctx
        self.name = name  # "ws3", "riva7": in logs
        self.log = log  # the adapter's logger
        self.flush_input = flush_input
        self.on_drop = on_drop
        # An item of a realtime session (realtime_slots.py): its results, errors included, go to
        # the item manager, which renders them into the socket's one outbox; None: to our outbox.
        self.results = results
        self.outbox = Outbox(max_queued)  # StreamResult | adapter messages | Failure (first)
        self.mode_label = str(ctx.model.geometry.context_right)  # the stream's chunk mode, for metrics
        self.stream = None  # the engine's handle once admitted
        self.interim_results = True  # partials reach the outbox (set by open)
        self.failure: Failure | None = None  # set once: everything after it is ignored
        self.client_gone = False  # the peer left (or was dropped): nothing can be sent any more
        self.input_ended = False
        self.end_reason: str | None = None  # why input ended: "end", "draining", "max_stream_duration"
        self.done = False  # the engine's last result (done) arrived
        self.admitted = False  # counted open in the metrics; close() counts it closed
        self.opened_at = 0.0  # the duration clock, from admission
        self.last_input = time.monotonic()  # the idle clock
        self.pushed_s = 0.0  # model-rate audio pushed
        self.processed_s = 0.0  # of it, what the model consumed
        self._loop = asyncio.get_running_loop()
        self._progress = asyncio.Event()  # set when the model consumed more audio, or the session ends

    @property
    def closing(self) -> bool:
        return self.failure is not None

    @property
    def streaming(self) -> bool:
        """Admitted, input open, not failed."""
        return self.stream is not None and not self.input_ended and not self.closing

    # ------------------------------------------------------------------ in
    def open(self, context_right: int | None = None, *, interim_results: bool = True, config_prefix: str = "",
             **stream_options) -> bool:  # fmt: skip
        """Take a slot (ServerContext.admit) and open the engine stream; False when the session
        failed instead: Failure "refused" or, for options the engine does not serve, "bad_config"
        (its reason after `config_prefix`: where the adapter's request names the option)."""
        self.interim_results = interim_results
        try:
            self.stream = self.ctx.admit(self._on_result, context_right=context_right, **stream_options)
        except Refused as e:
            self.fail(e.reason, "refused", refusal=e.label)
            return False
        except ValueError as e:  # unknown language or mode (the message lists the valid ones), bad phrases
            self.fail(config_prefix + str(e), "bad_config")
            return False
        self.opened_at = time.monotonic()
        self.admitted = True
        self.mode_label = str(self.ctx.model.geometry_for(context_right).context_right)
        self.ctx.metrics.stream_opened(self.mode_label)
        return True

    def open_item(self, context_right: int | None = None, **stream_options) -> None:
        """Open the engine stream of a stream admitted already: a realtime item, whose session was
        admitted at its first append (one admission, one guard move, counted open once). Not
        counted here; NoFreeSlotError and ValueError (options the engine does not serve)
        propagate: the item manager waits for a slot of its own or fails its session."""
        self.stream = self.ctx.engine.open_stream(self._on_result, context_right=context_right, **stream_options)
        self.opened_at = time.monotonic()

    def push(self, samples: np.ndarray) -> None:
        """Model-rate samples for the engine; ignored once input ended or the session failed."""
        if self.streaming and len(samples):
            self.ctx.engine.push(self.stream, samples)
            self.pushed_s += len(samples) / self.ctx.model.geometry.sample_rate

    def force_final(self, at_sample: int | None = None) -> None:
        """The segment closes at the audio so far; `at_sample` (samples pushed since the stream
        opened): after the whole chunks before it, however far the model has got (engine_api)."""
        if self.streaming:
            self.ctx.engine.force_final(self.stream, at_sample)

    def end_input(self, reason: str = "end") -> None:
        """Input ends: the adapter's tail pushed, then the stream decoded to its end; the results
        still owed come out, then `done`. Idempotent. ValueError from flush_input propagates."""
        if not self.streaming:
            return
        if self.flush_input is not None:
            self.push(self.flush_input())
        self.input_ended, self.end_reason = True, reason
        self.ctx.engine.finish(self.stream)
        self._progress.set()

    def fail(self, reason: str, reason_label: str = "protocol", refusal: str | None = None) -> None:
        """Abort the engine stream (its slot comes back between steps), count the reason and put
        the Failure first in the outbox (results still waiting are dropped). Once."""
        if self.closing or self.client_gone:
            return
        label = reason_label
        self.failure = Failure(label, clean(reason, MAX_REASON_CHARS), refusal)
        self._progress.set()
        self._abort(reason)
        self.ctx.metrics.stream_errors.labels(reason=label).inc()
        self.log.info("%s error (%s): %s", self.name, label, self.failure.reason)
        self.outbox.put_first(self.failure)

    def gone(self) -> None:
        """The client left: nothing more is sent; the engine stream is aborted now."""
        self.client_gone = True
        self._progress.set()
        self._abort("client gone")

    def close(self, reason: str = "session ended") -> None:
        """The adapter's `finally:`, whatever ended the session: the slot comes back, the stream
        no longer counts as open. Idempotent."""
        self._abort(reason)
        if self.admitted:
            self.admitted = False
            self.ctx.metrics.stream_closed(self.mode_label)

    def _abort(self, reason: str) -> None:
        if self.stream is not None:
            self.ctx.engine.abort(self.stream, reason)  # idempotent; a no-op once the stream is done

    # ------------------------------------------------------------------ what ServerContext calls
    def drain(self) -> None:
        """Server shutdown: input ends so the final comes out; not admitted yet: refused."""
        if self.stream is None:
            self.fail("server is draining (shutting down)", "draining")
            return
        try:
            self.end_input("draining")
        except ValueError as e:  # the audio ended inside its header
            self.fail(str(e), "bad_audio")

    def drop(self) -> None:
        """The drain's last resort, for a client that does not take its failure: cut the transport."""
        self._abort("connection dropped")
        if self.on_drop is not None:
            self.on_drop()

    # ------------------------------------------------------------------ clocks and flow
    def input_deadline(self) -> float | None:
        """When the idle clock (or, while streaming, the duration clock) runs out, in
        time.monotonic(); None once input ended: the server owes results, and the drain deadline
        bounds that wait at shutdown."""
        if self.input_ended:
            return None
        s = self.ctx.settings
        deadline = self.last_input + s.idle_timeout_s
        if self.streaming:
            deadline = min(deadline, self.opened_at + s.max_stream_s)
        return deadline

    def input_deadline_passed(self) -> None:
        """A clock ran out: past --max-stream-s input ends ("max_stream_duration"), else the
        session fails ("idle_timeout")."""
        s = self.ctx.settings
        if self.streaming and time.monotonic() >= self.opened_at + s.max_stream_s:
            self.end_input("max_stream_duration")
        else:
            self.fail(f"idle timeout: no message for {s.idle_timeout_s:g} s", "idle_timeout")

    async def receive(self, read: Callable[[], Awaitable]):
        """The client's next message, waited for no longer than input_deadline allows; None when
        a clock ran out (input_deadline_passed acted on it)."""
        deadline = self.input_deadline()
        try:
            timeout_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            message = await asyncio.wait_for(read(), timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself only from 3.11
            self.input_deadline_passed()
            return None
        self.last_input = time.monotonic()
        return message

    @property
    def behind_s(self) -> float:
        """Audio pushed that the model has not consumed yet."""
        return self.pushed_s - self.processed_s

    def model_behind(self) -> bool:
        """Streaming, and the model more than MAX_AHEAD_S behind this stream's input: the adapter
        reads nothing more until it catches up (wait_for_model)."""
        return self.streaming and self.behind_s > MAX_AHEAD_S

    async def wait_for_model(self) -> None:
        """Return once the model is at most MAX_AHEAD_S behind this stream's input (at once
        unless streaming): the adapter stops reading meanwhile."""
        while self.model_behind():
            self._progress.clear()
            await self._progress.wait()
            self.last_input = time.monotonic()  # waiting on us is not the client being idle

    async def send(self, write: Awaitable) -> bool:
        """One write to the client within --send-timeout-s; False (and the session failed
        "slow_client") when the client took nothing in that time."""
        timeout_s = self.ctx.settings.send_timeout_s
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the write in a task of its
        # own, a task and an extra event-loop pass for every result message sent.
        try:
            async with asyncio.timeout(timeout_s):
                await write
        except TimeoutError:
            self.fail(f"client is not reading results (none written for {timeout_s:g} s)", "slow_client")
            return False
        return True

    # ------------------------------------------------------------------ out
    def queue(self, item) -> None:
        """An adapter message (or result) for the client; a full outbox: the client is not reading."""
        if not self.closing and not self.outbox.put(item):
            self.fail(f"client is not reading results ({len(self.outbox)} messages waiting)", "slow_client")

    async def next_event(self):
        """The next StreamResult, adapter message or Failure for the client, in order."""
        return await self.outbox.get()

    def result_sent(self, r: StreamResult) -> None:
        """The adapter wrote `r`: its latency observed."""
        self.ctx.metrics.result_sent(r.is_final, self.mode_label, max(0.0, time.time() - r.audio_arrival_time))

    # ------------------------------------------------------------------ result intake (the one)
    def _on_result(self, result: StreamResult) -> None:
        """The engine's callback (its loop thread, or this event loop): hand over at once."""
        hand_over(self._loop, self._take_result, result)

    def _take_result(self, r: StreamResult) -> None:
        if self.results is not None:
            self.results(r)  # the item manager judges it (its session may have ended) and counts it
            return
        if self.closing or self.client_gone:
            return
        if r.error is not None:
            self.fail(f"engine error: {r.error}", "engine")
            return
        self.progressed(r)
        if r.is_final or r.done or self.interim_results:
            self.queue(r)

    def progressed(self, r: StreamResult) -> None:
        """Result `r` counted: the model's progress, whether or not the client reads (so
        backpressure never waits on the client), and the `done`."""
        self.ctx.metrics.audio_seconds.inc(max(0.0, r.audio_processed_s - self.processed_s))
        self.processed_s = max(self.processed_s, r.audio_processed_s)
        self.done = self.done or r.done
        self._progress.set()
