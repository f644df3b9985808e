"""EngineClient: the Engine's network-side API, inside a front-end process.

Sessions call the same methods as on the in-process Engine (open_stream, push, finish,
force_final, abort, num_free_slots, error); here they become a slot taken in shared memory,
samples written into the slot's ring, and small control messages to the core. The ring's new end
is published one of two ways (shared.py): stored in shared memory after the samples, with a
`Wake` only for a core that sleeps; or (NEMO_SERVE_RING_POSITIONS=messages) one `Wrote` per
event-loop tick, at most one per WROTE_PERIOD_S, with every ring's new end. The core's
StreamUpdates come back on one socket; a task on the event loop assembles each into the
StreamResult the session expects (text and detokenisation happen here, not in the core).

The core's overload guard (admission.py) keeps its state in the core's shared block, so
every front end judges new streams by the same cap; its decisions take the slot table's lock.

Everything runs on the front end's event loop thread: no locks besides the slot table's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import deque
from typing import Callable

import numpy as np
import zmq
import zmq.asyncio

from ..engine.endpoint import EndpointConfig
from ..engine.geometry import ModelInfo
from ..engine.phrases import PhraseLimits, check_phrases, encodable_characters
from ..engine.speakers import check_diarization
from ..engine.results import Detokenizer, ResultAssembler, StreamResult, StreamUpdate
from ..admission import OverloadGuard, Verdict
from . import messages as m
from .addresses import control_address, results_address
from .shared import FAILED, SERVING, STOPPED, SharedSlots, fence

log = logging.getLogger("nemo_serve.frontend")

FLUSH_PERIOD_S = 0.005  # retry for audio that did not fit in a full ring
# At most one Wrote per this period (benchmarks/packet_cost.py: a ZMQ message and the wake-up of
# the ZMQ I/O thread were the largest share of a paced packet's CPU when each packet had its own
# tick, as it has when streams are independent clients). Rings written meanwhile share the next
# one: the core sees new audio at most this much later, against chunks of 80 ms and more.
# Rejected: one Wrote per core step (the front end does not know when the core plans). Where the
# ring positions live in shared memory (shared.py) there is no Wrote at all.
WROTE_PERIOD_S = 0.002
_F32 = np.dtype(np.float32)


class EngineFailed(RuntimeError):
    """The engine core process is gone or reported a failure."""


@dataclasses.dataclass(eq=False)
class StreamHandle:
    stream_id: str
    slot: int
    gen: int
    on_result: Callable[[StreamResult], None]
    assemble: ResultAssembler
    pending: deque = dataclasses.field(default_factory=deque)  # audio waiting for ring space
    written: int = 0  # samples written into the ring
    read: int = 0  # samples the core has said it read (Results): the ring space before is free
    arrival: float = 0.0  # time.time() when the newest written samples arrived
    finish_pending: bool = False
    ended: bool = False  # aborted, or its last result was delivered
    engine: object = None  # the EngineClient that serves it (set by an EngineGroup)
    num_phrases: int = 0  # boosted phrases it holds (the front end's share of --max-phrases-total)
    num_forced: int = 0  # positional ForceFinals sent (shared positions: SharedSlots.publish_forced)


class EngineClient:
    def __init__(self, info: ModelInfo, shared: SharedSlots, frontend: int, ipc_dir: str, max_batch: int | None = None,
                 phrase_limits: PhraseLimits = PhraseLimits(), max_queue_delay_s: float = 0.0) -> None:  # fmt: skip
        self.model_info = info
        self.phrase_limits = phrase_limits
        self.encodable = encodable_characters(info.vocabulary)
        self.shared = shared
        self.frontend = frontend
        self.ipc_dir = ipc_dir
        self.num_slots = shared.num_slots
        # State in the shared block: every front end of this core sees each decision.
        self.guard = OverloadGuard(max_queue_delay_s, self.num_slots, store=shared, lock=shared.lock)
        self.detok = Detokenizer(info.vocabulary, info.is_bpe)
        self.frame_s = info.geometry.encoder_frame_s
        self._streams: dict[str, StreamHandle] = {}
        self._by_slot: dict[int, StreamHandle] = {}  # the open streams again, by ring
        self._unannounced: dict[StreamHandle, None] = {}  # rings written since the last Wrote (ordered set)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(): Wrote goes once per tick
        self._last_wrote = float("-inf")  # loop time of the last Wrote (WROTE_PERIOD_S)
        self._positions_in_shared = shared.layout.positions_in_shared  # no Wrote: shared.py
        self._woken_epoch = 0  # the core's last sleep this front end sent a Wake for
        self._pending: set[StreamHandle] = set()
        self._wake_flush = asyncio.Event()
        self._zmq: zmq.asyncio.Context | None = None
        self._control = None
        self._results = None
        self._tasks: list[asyncio.Task] = []
        self._encoder = m.msgspec.msgpack.Encoder()
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return self._zmq is not None

    def start(self) -> "EngineClient":
        """On the event loop (the app's lifespan)."""
        self._loop = asyncio.get_running_loop()
        self._zmq = zmq.asyncio.Context()
        self._results = self._zmq.socket(zmq.PULL)
        self._results.setsockopt(zmq.RCVHWM, 0)
        self._results.bind(results_address(self.ipc_dir, self.frontend))
        self._control = self._zmq.socket(zmq.PUSH)
        self._control.setsockopt(zmq.SNDHWM, 0)
        self._control.setsockopt(zmq.LINGER, 2000)  # aborts sent at shutdown still reach the core
        self._control.connect(control_address(self.ipc_dir))
        # Sent through a plain view of the same socket: HWM 0 never blocks, so the asyncio
        # wrapper's future per message is pure cost (about 3 us a message, packet_cost.py).
        self._control_send = zmq.Socket.shadow(self._control.underlying).send
        self._tasks = [
            asyncio.create_task(self._receive_results(), name="engine-results"),
            asyncio.create_task(self._flush_pending(), name="engine-ring-flush"),
        ]
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stopped = True
        for t in self._tasks:
            t.cancel()
        if self._zmq is not None:
            self._results.close(0)
            self._control.close(int(timeout_s * 1000))
            self._zmq.term()

    @property
    def error(self) -> BaseException | None:
        state = int(self.shared.state[0])
        if state == FAILED:
            return EngineFailed("engine core failed")
        if state == STOPPED and not self._stopped:
            return EngineFailed("engine core stopped")
        return None

    @property
    def serving(self) -> bool:
        return int(self.shared.state[0]) == SERVING

    # ------------------------------------------------------------------ network-side API
    def open_stream(
        self,
        on_result: Callable[[StreamResult], None],
        *,
        stream_id: str | None = None,
        language: str | None = None,
        endpoint: EndpointConfig | None = None,
        context_right: int | None = None,
        phrases: list[str] | None = None,
        boost: float | None = None,
        diarization: dict | None = None,
    ) -> StreamHandle:
        """Take a slot now, or raise NoFreeSlotError / ValueError (bad language, mode or phrases;
        the phrase total: this front end's share, frontend_process.py; the core counts the whole)."""
        lang = self.model_info.language_index(language)
        mode = self.model_info.geometry_for(context_right).context_right
        request = check_phrases(phrases, boost, self.phrase_limits, self.encodable, self.model_info.is_bpe)
        check_diarization(diarization, self.model_info.num_speakers)
        if request:  # a sum over the open streams, for boosted opens only
            held = sum(h.num_phrases for h in self._streams.values())
            if held + len(request.phrases) > self.phrase_limits.max_phrases_total:
                raise ValueError(f"this front end holds {held} boosted phrases; at most "
                                 f"{self.phrase_limits.max_phrases_total} in all (its share of the server's)")  # fmt: skip
        stream_id = stream_id or uuid.uuid4().hex
        if stream_id in self._streams:
            raise ValueError(f"stream id {stream_id!r} is already open")
        slot, gen = self.shared.allocate(self.frontend, mode)
        h = StreamHandle(stream_id, slot, gen, on_result, ResultAssembler(self.detok, self.frame_s),
                         num_phrases=len(request.phrases))  # fmt: skip
        self._streams[stream_id] = h
        self._by_slot[slot] = h
        ep = dataclasses.asdict(endpoint) if endpoint is not None else {}
        self._send(m.Open(slot, gen, self.frontend, stream_id, lang, ep, mode,
                          list(request.phrases) or None, request.boost if request else None, diarization))  # fmt: skip
        return h

    def push(self, h: StreamHandle, samples: np.ndarray, arrived: float | None = None) -> None:
        if h.ended or len(samples) == 0:
            return
        if type(samples) is not np.ndarray or samples.dtype is not _F32 or samples.ndim != 1:
            samples = np.asarray(samples, dtype=np.float32).reshape(-1)  # what decoders give needs none
        now = time.time() if arrived is None else arrived
        rest = samples if h.pending else self._write(h, samples, now)
        if rest is not None:
            h.pending.append((rest, now))
            self._pending.add(h)
            self._wake_flush.set()

    def finish(self, h: StreamHandle) -> None:
        if h.ended:
            return
        if h.pending:
            h.finish_pending = True  # sent once the ring took the rest of the audio
        else:
            self._send(m.Finish(h.slot, h.gen))

    def force_final(self, h: StreamHandle, at_sample: int | None = None) -> None:
        if h.ended:
            return
        self._send(m.ForceFinal(h.slot, h.gen, at_sample))
        if at_sample is not None and self._positions_in_shared and self._holds_slot(h):
            h.num_forced += 1  # the core reads no audio past it before this message (shared.py)
            self.shared.publish_forced(h.slot, h.gen, h.num_forced)

    def abort(self, h: StreamHandle, reason: str = "aborted") -> None:
        """No further results are delivered. Idempotent."""
        if h.ended:
            return
        h.ended = True
        self._streams.pop(h.stream_id, None)
        self._forget_slot(h)
        self._pending.discard(h)
        self._send(m.Abort(h.slot, h.gen, reason))

    def fail_streams(self, reason: str) -> int:
        """Every open stream gets an error result (its core died while others serve on); the count."""
        handles = list(self._streams.values())
        self._streams.clear()
        for h in handles:
            h.ended = True
            self._forget_slot(h)
            self._pending.discard(h)
            update = StreamUpdate(h.stream_id, 0, True, True, [], [], 0, 0.0, time.time(), error=reason)
            try:
                h.on_result(h.assemble(update))
            except Exception:  # noqa: BLE001 - one session's bug must not stop the others' errors
                log.exception("error delivery failed for stream %s", h.stream_id)
        return len(handles)

    @property
    def num_free_slots(self) -> int:
        return self.shared.num_free

    @property
    def num_open_streams(self) -> int:
        return self.num_slots - self.shared.num_free

    @property
    def queue_delay_s(self) -> float:
        """How far behind real time the core recently was (engine/queue_delay.py), from shared memory."""
        return self.shared.queue_delay_s(time.time())

    def open_by_mode(self) -> dict[int, int]:
        """Slots held, by chunk mode, across every front end."""
        return self.shared.open_by_mode()

    def overload(self, decide: bool = False, now: float | None = None) -> Verdict:
        """This core's overload guard on its own numbers; `decide`: for a stream being admitted or
        refused now (moves the guard, for every front end), else reads only (/readyz)."""
        return self.guard.judge(self.queue_delay_s, self.num_open_streams, now or time.time(), decide)

    # ------------------------------------------------------------------ internals
    def _send(self, msg) -> None:
        self._announce_written()  # first: a Finish must reach the core after the audio it ends
        self._send_now(msg)

    def _send_now(self, msg) -> None:
        if self._control is not None and not self._stopped:
            self._control_send(self._encoder.encode(msg))  # HWM 0: queues, never blocks

    def _forget_slot(self, h: StreamHandle) -> None:
        if self._by_slot.get(h.slot) is h:  # the slot may already hold this front end's next stream
            del self._by_slot[h.slot]

    def _write(self, h: StreamHandle, samples: np.ndarray, now: float) -> np.ndarray | None:
        """Write what fits into the slot's ring; the rest, or None when all of it went in."""
        if not self._holds_slot(h):
            return None  # released by the core: its `done` is on the way; the audio is dropped
        n, size = len(samples), self.shared.ring_samples
        k = size - (h.written - h.read)  # the free space as last heard
        if k < n and self._positions_in_shared:  # the core may have read more since
            k = size - (h.written - self._shared_read_end(h))
        if k <= 0:
            return samples
        if k >= n:  # the common case: all of it, with no slice made
            k = n
        self.shared.write(h.slot, h.written, samples if k == n else samples[:k])
        h.written += k
        h.arrival = now
        if self._positions_in_shared:
            self._publish_written(h)
        else:
            self._announce_later(h)
        return samples[k:] if k < n else None

    def _announce_later(self, h: StreamHandle) -> None:
        """Positions in messages: the ring in the next Wrote."""
        if not self._unannounced and self._loop is not None:
            self._schedule_announce()
        self._unannounced[h] = None
        if self._loop is None:  # not started (tests): at once
            self._announce_written()

    def _shared_read_end(self, h: StreamHandle) -> int:
        """Shared positions: how far the core has read the stream's ring (only the core stores it,
        for the slot's open stream; allocate() zeroed it for this one)."""
        h.read = int(self.shared.read_end[h.slot])
        fence()  # the read end before the writes into the space it frees
        return h.read

    def _publish_written(self, h: StreamHandle) -> None:
        """Shared positions: the ring's new end where the core reads it; a Wake if the core sleeps
        and this front end has not woken it from this sleep yet (shared.py, the wake-up)."""
        epoch = self.shared.publish_write(h.slot, h.gen, h.written, h.arrival)
        if epoch and epoch != self._woken_epoch:
            self._woken_epoch = epoch
            self._send_now(m.Wake())

    def _holds_slot(self, h: StreamHandle) -> bool:
        """Whether the slot is still this stream's in the slot table. The core frees a released
        stream's slot before its front end hears `done`, and another stream may take it meanwhile:
        a write for the old stream would land in the new one's ring (tests/test_client_late_push.py).
        Checked without the lock: only a release and a new allocation and write by another front
        end, all within this call, could still slip past, against a window of a round trip."""
        slot = h.slot
        return self.shared.gen[slot] == h.gen and self.shared.owner[slot] == self.frontend

    def _schedule_announce(self) -> None:
        """The next Wrote: at the end of this tick, or WROTE_PERIOD_S after the last one."""
        wait_s = self._last_wrote + WROTE_PERIOD_S - self._loop.time()
        if wait_s <= 0:
            self._loop.call_soon(self._announce_written)  # every ring written in this tick
        else:
            self._loop.call_later(wait_s, self._announce_written)

    def _announce_written(self) -> None:
        """One Wrote for every ring written since the last: sent after the samples (shared.py)."""
        if not self._unannounced:
            return
        if self._loop is not None:
            self._last_wrote = self._loop.time()
        hs = list(self._unannounced)
        self._unannounced.clear()
        n = len(hs)
        self._send_now(m.Wrote(
            np.fromiter((h.slot for h in hs), m.SLOT, n).tobytes(), np.fromiter((h.gen for h in hs), m.GEN, n).tobytes(),
            np.fromiter((h.written for h in hs), m.POS, n).tobytes(), np.fromiter((h.arrival for h in hs), m.TIME, n).tobytes(),
        ))  # fmt: skip

    def _apply_read(self, results: m.Results) -> None:
        """The core has copied these rings' samples up to `read_ends` out: that space is free."""
        slots, gens = np.frombuffer(results.slots, m.SLOT).tolist(), np.frombuffer(results.gens, m.GEN).tolist()
        for slot, gen, end in zip(slots, gens, np.frombuffer(results.read_ends, m.POS).tolist()):
            h = self._by_slot.get(slot)
            if h is not None and h.gen == gen:  # not a report for the slot's previous stream
                h.read = end

    async def _flush_pending(self) -> None:
        """Audio that found its ring full (the core is behind): retried until it fits, in order."""
        while True:
            await self._wake_flush.wait()
            while self._pending:
                for h in list(self._pending):
                    while h.pending and not h.ended:
                        samples, now = h.pending[0]
                        rest = self._write(h, samples, now)
                        if rest is not None:
                            h.pending[0] = (rest, now)
                            break
                        h.pending.popleft()
                    if not h.pending or h.ended:
                        self._pending.discard(h)
                        if h.finish_pending and not h.ended:
                            h.finish_pending = False
                            self._send(m.Finish(h.slot, h.gen))
                if self._pending:
                    await asyncio.sleep(FLUSH_PERIOD_S)
            self._wake_flush.clear()

    async def _receive_results(self) -> None:
        while True:
            raw = await self._results.recv(copy=False)
            results = m.results_decoder.decode(raw.buffer)
            self._apply_read(results)
            for u in results.updates:
                h = self._streams.get(u.stream_id)
                if h is None:
                    continue  # aborted here meanwhile
                if u.done:
                    h.ended = True
                    del self._streams[u.stream_id]
                    self._forget_slot(h)
                try:
                    h.on_result(h.assemble(u))
                except Exception:  # noqa: BLE001 - one session's bug must not stop the others' results
                    log.exception("result delivery failed for stream %s", u.stream_id)
