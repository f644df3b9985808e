"""The step loop: one thread owns the model and advances every ready stream.

Network side (any thread)            loop thread
  admit / push / finish         ->   1 drain the queues: opens, aborts, force-finals, and the
  abort / force_final                  streams with new audio (absorbed; nobody else is visited)
                                     2-3 scheduler.plan: readiness and grouping as array
                                       operations over slots (by mode, first | later chunks),
                                       earliest deadline first
  IterationOutput               <-   4 features + one batched step per group
                                     5 results and endpoints, collected
                                     6 release finished streams

`iterate()` returns what it produced (engine/outputs.py) and calls nobody back: the engine core
routes the output to its front ends; `open_stream` with a consumer, `start()` and `on_step` are
the in-process harness around it (tests, --selftest, the one-process server), which hands each
update to its stream's consumer.

Nobody configures a batch size: the streams that became ready while the previous step ran
form the next batch (capped at max_batch). Nothing waits to fill a batch.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .biasing import BiasingRegistry
from .phrases import NO_BIASING, PhraseLimits, PhraseRequest, check_phrases, encodable_characters
from .encoder import make_encoder
from .endpoint import EndpointConfig
from .frontend import FeatureExtractor
from .scheduler import Group, Scheduler
from .outputs import IterationOutput, ReleasedStream, StepStats
from .geometry import ModelInfo
from .invariants import check, from_env as invariant_log
from .queue_delay import QueueDelay
from .slot_table import SlotTable
from .slots import SlotPool
from .step import StepBatch, prepare_step, run_step
from .results import Detokenizer, ResultAssembler, StreamResult, StreamUpdate
from .stream import Phase, Stream
from ..server.admission import OverloadGuard, Verdict

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    """One row of a planned call, as `Engine.plan()` shows it: feature frames [t0, t0 + num_frames)."""

    stream_id: str
    t0: int
    num_frames: int
    is_first: bool
    is_last: bool


@dataclass
class EngineStats:
    steps: int = 0
    stream_steps: int = 0
    audio_s: float = 0.0
    by_mode: dict = field(default_factory=dict)  # context_right -> [steps, stream_steps]


class Engine:
    """Streams in, results out. All model work happens on the loop thread started by `start()`."""

    def __init__(
        self,
        model,
        num_slots: int = 64,
        max_batch: int | None = None,
        endpoint: EndpointConfig = EndpointConfig(),
        on_step: Callable[[int, float, int], None] | None = None,
        kv_cache: bool = True,
        token_confidence: bool = False,
        phrase_limits: PhraseLimits = PhraseLimits(),
        max_queue_delay_s: float = 0.0,
    ) -> None:
        """`kv_cache`: cache projected keys/values (engine/encoder.py) where the architecture
        allows; False runs NeMo's own layer code (caches layer inputs). `token_confidence`: each
        new token comes with the decoder's confidence (engine/step.py), for word confidences."""
        self.model = model
        self.geometry = model.geometry
        self.num_slots = num_slots
        self.max_batch = max_batch or num_slots
        self.endpoint = endpoint
        self.on_step = on_step  # harness metrics hook: (batch size, seconds, the group's context_right)
        self.encoder = make_encoder(model, kv_cache=kv_cache)  # loop thread only
        self.pool = SlotPool(model, num_slots, self.encoder.channel_shape)  # loop thread only
        self.token_confidence = token_confidence
        self.phrase_limits = phrase_limits
        self.encodable = encodable_characters(model.vocabulary)
        self._num_phrases = 0  # phrases of the admitted streams (guarded by _admission)
        self.features = FeatureExtractor.for_model(model)
        self.detok = Detokenizer(model.vocabulary, model.is_bpe)
        self.hop_s = self.geometry.hop_samples / self.geometry.sample_rate
        self.model_info = ModelInfo(
            name=model.name,
            geometry=model.geometry,
            geometries=dict(model.geometries),
            vocabulary=list(model.vocabulary),
            is_bpe=model.is_bpe,
            prompt_dictionary=dict(model.prompt_dictionary) if model.prompt_dictionary else None,
            default_language=model.default_language,
            feature_margin=self.features.margin,
            summary=self.summary(),
        )
        self.stats = EngineStats()
        self.queue_delay = QueueDelay()  # recorded on the loop thread, read by admission (any thread)
        # In process the overload guard keeps its state in memory; an engine core's front ends
        # keep theirs in the core's shared block (core/client.py) and never ask this one.
        self.overload_guard = OverloadGuard(max_queue_delay_s, num_slots)
        self.scheduler = Scheduler(self.geometry, num_slots, self.max_batch, self.features.margin)  # loop thread only
        # Which stream holds each slot (its cache row and scheduler row): the one record of it.
        self.slots = SlotTable(num_slots)  # changed under _admission (admit, release)
        self._to_release: list[Stream] = []  # streams done since the last release; loop thread only
        # What the current iteration produced (plan() may publish forced finals too); loop thread only.
        self._updates: list[StreamUpdate] = []
        self._update_slots: list[int] = []  # each update's slot
        self._released: list[ReleasedStream] = []
        self._steps: list[StepStats] = []
        # In-process harness: stream id -> its consumer, from open_stream until its release is
        # delivered (an id stays taken until then, so a reused id never gets another's results).
        self._consumers: dict[str, Callable[[StreamUpdate], None]] = {}
        # From any thread to the loop: streams to open, streams with a request (abort, force
        # final), streams with new audio or end of input. Queues, so the loop visits only them.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._dirty: queue.SimpleQueue = queue.SimpleQueue()
        self._admission = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def summary(self) -> str:
        layout = "keys/values cached" if self.encoder.kind == "kv" else "NeMo layer inputs cached"
        line = self.model.summary(self.num_slots, self.pool.cache_bytes_per_stream, layout)
        if len(self.model.modes) > 1:
            # One pool serves every mode, sized for the largest; what each mode alone would need.
            alone = ", ".join(
                f"{g.chunk_ms:.0f} ms {self.encoder.cache_bytes_for(r, self.pool.cache_bytes_per_stream) / 2**20:.2f} MiB"
                for r, g in self.model.geometries.items()
            )
            line += f"; one slot pool for every mode (a mode alone would need per stream: {alone})"
        return line

    def prepare(self) -> str | None:
        """Start-up, before the first stream: on CUDA, capture every mode's and bucket's graphs now
        (ours and NeMo's decoders, with token confidence as the engine runs them), not during
        traffic, and log one line with the time and GPU memory it took; returns that line. On CPU
        a no-op (nothing to capture; the steppers are built on first use). Every server calls it
        (compose.load_engine)."""
        dev = self.model.device
        if dev.type != "cuda":
            return None
        before = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        t = time.perf_counter()
        steppers = prepare_step(self.model, self.encoder, self.pool, confidence=self.token_confidence)
        elapsed = time.perf_counter() - t  # prepare() ends with a synchronize
        alloc, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        reports = [s.report() for s in steppers]
        captured = sum(len(r["encoder_captured"]) for r in reports)
        failed = sum(len(r["encoder_failed"]) for r in reports)
        eager_decoders = sum(m == "no_graphs" for r in reports for m in r["decoder_modes"].values())
        line = (
            f"CUDA graphs captured at start-up in {elapsed:.1f} s: {captured} encoder graphs over "
            f"{len(steppers)} mode(s) x {len(steppers[0].sizes)} buckets"
            + (f", {failed} failed (run eagerly)" if failed else "")
            + (f", {eager_decoders} decoders without graphs" if eager_decoders else "")
            + f"; GPU memory allocated {alloc / 2**30:.2f} GiB (+{(alloc - before[0]) / 2**30:.2f}),"
            f" reserved {reserved / 2**30:.2f} GiB (+{(reserved - before[1]) / 2**30:.2f})"
        )
        log.info(line)
        return line

    # ------------------------------------------------------------------ network-side API
    def open_stream(
        self,
        on_result: Callable[[StreamResult], None] | Callable[[StreamUpdate], None],
        *,
        stream_id: str | None = None,
        updates: bool = False,
        **admission,
    ) -> Stream:
        """In-process harness: `admit` a stream whose results `iterate()` hands to `on_result`
        (on the thread that iterates), each as a `StreamResult` (text and the segment's tokens,
        assembled here) or, if `updates`, each raw `StreamUpdate`."""
        if not updates:
            on_result = _assembling(on_result, self.detok, self.geometry.encoder_frame_s)
        stream_id = stream_id or uuid.uuid4().hex
        if self._consumers.setdefault(stream_id, on_result) is not on_result:  # atomic under the GIL
            raise ValueError(f"stream id {stream_id!r} is already open")
        try:
            return self.admit(stream_id=stream_id, **admission)
        except BaseException:
            del self._consumers[stream_id]
            raise

    def admit(
        self,
        *,
        stream_id: str | None = None,
        language: str | None = None,
        language_index: int | None = None,
        endpoint: EndpointConfig | None = None,
        context_right: int | None = None,
        phrases: list[str] | None = None,
        boost: float | None = None,
        slot: int | None = None,
    ) -> Stream:
        """Admit a stream or raise NoFreeSlotError / ValueError (bad language, a chunk mode
        `context_right` the engine does not serve: the message lists those it does, or bad
        `phrases` / `boost`: engine/biasing.py, over a limit or not spelled by the tokenizer).
        `slot`: the one it must hold (the engine core's: the ring its front end was given; it
        must be free), else the lowest free one. Its results come out of `iterate()`. Any thread."""
        lang = self.model.language_index(language) if language_index is None else language_index
        mode = self.model.geometry_for(context_right).context_right
        request = self.check_phrases(phrases, boost)
        stream = Stream(
            stream_id=stream_id or uuid.uuid4().hex,
            language_index=lang,
            endpoint_config=endpoint or self.endpoint,
            frame_s=self.geometry.encoder_frame_s,
            context_right=mode,
            phrases=request,
        )
        with self._admission:
            total = self._num_phrases + len(request.phrases)
            if request and total > self.phrase_limits.max_phrases_total:
                raise ValueError(f"the server holds {self._num_phrases} boosted phrases; "
                                 f"at most {self.phrase_limits.max_phrases_total} in all")  # fmt: skip
            self.slots.take(stream, slot)
            self._num_phrases = total
        self._inbox.put(stream)
        self._wake.set()
        return stream

    def check_phrases(self, phrases: list[str] | None, boost: float | None) -> PhraseRequest:
        """The stream's phrases checked against the limits and the tokenizer (no <unk>): the
        tokenizer is pure host code, so the caller's thread may run it."""
        request = check_phrases(phrases, boost, self.phrase_limits, self.encodable, self.model.is_bpe)
        tokenizer = getattr(self.model.nemo, "tokenizer", None)
        unk = getattr(tokenizer, "unk_id", None)
        for phrase in request.phrases if tokenizer is not None else ():
            if unk is not None and unk in tokenizer.text_to_ids(phrase):
                raise ValueError(f"phrase {phrase!r} has characters the model cannot spell")
        return request

    def _biasing(self) -> BiasingRegistry:
        """The registry, made with the first boosted stream (its multi-model holds device memory)."""
        if self.pool.biasing is None:
            blank = int(self.model.decoding_computer._blank_index)
            self.pool.biasing = BiasingRegistry(self.model.nemo.tokenizer, blank, self.model.device)
        return self.pool.biasing

    def push(self, stream: Stream, samples: np.ndarray, arrived: float | None = None) -> None:
        """`arrived`: server time the samples came in (default now). The engine keeps a reference
        to `samples` (no copy) until the loop absorbs them: the caller must not write to them."""
        stream.push(np.asarray(samples, dtype=np.float32).reshape(-1), arrived)
        self._dirty.put(stream)
        self._wake_loop()

    def take_audio(self, stream: Stream, parts: tuple[np.ndarray, ...], arrived: float) -> None:
        """`push` for a caller on the loop thread (the engine core, which drives `iterate()`
        itself): float32 samples in one or two pieces go straight into the stream's buffer and
        the scheduler, without the lock, queue and wake-up a network thread needs. `arrived` is
        the front end's time, so latency counts the wait in the audio ring. A stream the loop has
        not taken in yet goes the queued way (its buffer is absorbed when it gets its slot), as a
        copy: the caller reuses `parts` (ring space) as soon as this returns."""
        if stream.phase is not Phase.ACTIVE:
            self.push(stream, np.concatenate(parts), arrived)  # always a new array, even of one part
            return
        audio = stream.audio
        audio.extend(parts, arrived)
        self.scheduler.set_audio(stream.slot, audio.num_samples, audio.finished)

    def _wake_loop(self) -> None:
        # Event.set takes a lock and notifies even when the event is set already; a set event
        # means the loop has not cleared it yet and will iterate (and see this input) after it does.
        if not self._wake.is_set():
            self._wake.set()

    def finish(self, stream: Stream) -> None:
        stream.audio.finish()
        self._dirty.put(stream)
        self._wake_loop()

    def force_final(self, stream: Stream) -> None:
        stream.request_force_final()
        self._requests.put(stream)
        self._wake.set()

    def abort(self, stream: Stream, reason: str = "aborted") -> None:
        """Drop the stream between steps; no further results are delivered. Idempotent."""
        stream.request_abort(reason)
        self._requests.put(stream)
        self._wake.set()

    @property
    def num_free_slots(self) -> int:
        with self._admission:
            return self.slots.num_free

    @property
    def num_open_streams(self) -> int:
        with self._admission:
            return self.slots.num_used

    @property
    def queue_delay_s(self) -> float:
        """How far behind real time the step loop was in the last seconds (queue_delay.py)."""
        return self.queue_delay.value(time.time())

    def open_by_mode(self) -> dict[int, int]:
        """Streams admitted, by chunk mode (right context)."""
        with self._admission:
            modes = [s.context_right for s in self.slots.streams()]
        return {r: modes.count(r) for r in sorted(set(modes))}

    def overload(self, decide: bool = False) -> Verdict:
        """The overload guard on this engine's numbers (engine_api.py)."""
        return self.overload_guard.judge(self.queue_delay_s, self.num_open_streams, time.time(), decide)

    def cores(self) -> list[dict]:
        """This engine as the one core /readyz and /metrics show (engine_api.CoreStatus)."""
        serving = self.error is None
        return [{"core": 0, "device": str(self.model.device), "pid": os.getpid(), "serving": serving,
                 "free_slots": self.num_free_slots if serving else 0, "total_slots": self.num_slots,
                 "open_streams": self.num_open_streams if serving else 0,
                 "queue_delay_s": round(self.queue_delay_s, 3) if serving else 0.0,
                 "recovering_cap": self.overload().cap if serving else None}]  # fmt: skip

    @property
    def loop_stream_ids(self) -> list[str]:
        """Ids of the streams the step loop holds: taken in from the inbox, not yet released.
        Loop thread only (or an engine that is not started and driven with `iterate()`)."""
        return [s.stream_id for s in self.slots.streams() if s.phase is Phase.ACTIVE]

    def check_accounting(self, exact: bool = False) -> int:
        """Raise AccountingError unless the books agree (engine/invariants.py): the slot table
        partitions the slots between streams and the free list, each stream under its own slot
        and id; the streams taken in (their cache rows open) are exactly the scheduler's active
        slots; each boosted cache row is a boosted stream's. `exact`: also no stream admitted
        but not yet taken in (the engine core: it opens streams and iterates on one thread).
        Returns the streams holding a cache row. Between iterations, on the loop thread."""
        with self._admission:
            problems, streams = self.slots.problems(), self.slots.streams()
        for problem in problems:
            check(False, problem)
        taken_in = {s.slot for s in streams if s.phase is Phase.ACTIVE}
        pending = [s.stream_id for s in streams if s.phase is Phase.PENDING]
        done = [s.stream_id for s in streams if s.phase is Phase.DONE]
        active = set(np.flatnonzero(self.scheduler.active).tolist())
        check(not done, f"streams {done} done but still holding their slots between iterations")
        check(active == taken_in, f"{len(active)} scheduler slots active, {len(taken_in)} streams taken in "
                                  f"(slots {sorted(active ^ taken_in)} differ)")  # fmt: skip
        check(not exact or not pending, f"{len(streams)} streams admitted, {len(taken_in)} taken in")
        boosted = set(np.flatnonzero(self.pool.boosted[: self.num_slots]).tolist())
        want = {s.slot for s in streams if s.phase is Phase.ACTIVE and s.biasing_id != NO_BIASING}
        check(boosted == want, f"cache rows {sorted(boosted)} boosted, streams with phrases on {sorted(want)}")
        return len(taken_in)

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> "Engine":
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

    # ------------------------------------------------------------------ one iteration
    def iterate(self) -> IterationOutput:
        """One pass of the loop: what it produced (`.busy`: a stream advanced, so the caller
        should not sleep). Streams opened in-process get their updates here, in order."""
        groups = self._schedule()  # 1, 2, 3
        for group in groups:  # 4, 5
            self._step(group)
        self._release_finished()  # 6
        out = IterationOutput(tuple(self._updates), tuple(self._update_slots), tuple(self._released), tuple(self._steps),
                              self.queue_delay.published)  # fmt: skip
        self._updates.clear()
        self._update_slots.clear()
        self._released.clear()
        self._steps.clear()
        self._deliver(out)
        return out

    def _deliver(self, out: IterationOutput) -> None:
        """In-process harness: each update to its stream's consumer, the steps to `on_step`."""
        consumers = self._consumers
        if consumers:  # none when an engine core drives it (it admits, and routes the output itself)
            for update in out.updates:
                consumer = consumers.get(update.stream_id)
                if consumer is not None:
                    consumer(update)
            for released in out.released:
                consumers.pop(released.stream_id, None)
        if self.on_step is not None:
            for st in out.steps:
                self.on_step(st.batch_size, st.elapsed_s, st.context_right)

    def plan(self) -> list[list[Chunk]]:
        """The encoder calls `iterate()` runs next, in order: one list of chunks per batched call.

        Takes in newly opened streams, applies aborts and forced finals, absorbs audio (steps 1-2)
        and groups the ready streams (step 3) exactly as `iterate()` does: modes, and first chunks
        and later chunks, never share a call; earliest deadline first, at most `max_batch` chunks,
        and with several modes ready only the earliest-due mode's calls. Runs no model (a forced final, which needs none, is published here); a second call before
        `iterate()` returns the same plan unless input arrived in between. Loop thread only (or
        an engine that is not started and driven with `iterate()`).
        """
        return [
            [
                Chunk(self.slots.stream_at(slot).stream_id, t0, width, g.is_first, last)
                for slot, t0, width, last in zip(g.slots.tolist(), g.t0.tolist(), g.widths.tolist(), g.is_last.tolist())
            ]
            for g in self._schedule()
        ]

    def _schedule(self) -> list[Group]:
        self._drain_queues()  # 1
        groups, done = self.scheduler.plan(time.time())  # 2, 3
        for slot in done.tolist():  # input ended on a tail NeMo's loop would not encode
            self._mark_done(self.slots.stream_at(slot))
        if groups and groups[-1].context_right != groups[0].context_right:
            # Several modes ready: step only the earliest-due mode, then plan again. A long-chunk
            # step cannot be interrupted, so running every mode's groups back to back would make
            # short chunks that become ready meanwhile wait for all of it; planning after each mode
            # lets them go ahead of long-chunk work that still has slack (measured: docs/performance.md,
            # "Mixed latency modes"). The long-chunk groups stay ready and go once they are the
            # earliest due.
            groups = [g for g in groups if g.context_right == groups[0].context_right]
        return groups

    def _drain_queues(self) -> None:
        while True:
            try:
                stream = self._inbox.get_nowait()
            except queue.Empty:
                break
            stream.biasing_id, tree_state = NO_BIASING, 0
            if stream.phrases:  # checked at open: the tree builds
                stream.biasing_id, tree_state = self._biasing().acquire(stream.phrases)
            self.pool.open_row(stream.slot, stream.language_index, stream.biasing_id, tree_state)
            stream.phase = Phase.ACTIVE
            self.scheduler.admit(stream.slot, self.model.geometries[stream.context_right])
            self._dirty.put(stream)  # audio pushed before admission
        not_taken_in: list[Stream] = []
        while True:
            try:
                stream = self._requests.get_nowait()
            except queue.Empty:
                break
            if stream.phase is Phase.PENDING:
                # Opened after the inbox was taken above (another thread): its request waits for
                # its slot, next iteration. Consumed now, an abort would leave it holding the slot.
                not_taken_in.append(stream)
            elif stream.abort_reason is not None:
                self._mark_done(stream)  # nothing more is published for it
            elif stream.take_force_final() and stream.phase is Phase.ACTIVE:
                self._publish_final(stream, [], [], time.time(), done=False)
        for stream in not_taken_in:
            self._requests.put(stream)
        # Take the queued entries first, then absorb each stream once. Deduplicating while still
        # taking entries would drop a packet pushed after that stream's absorb (it hung a stream).
        dirty: dict[int, Stream] = {}
        while True:
            try:
                stream = self._dirty.get_nowait()
            except queue.Empty:
                break
            if stream.phase is Phase.ACTIVE:
                dirty[stream.slot] = stream
        for slot, stream in dirty.items():
            audio = stream.audio
            audio.absorb()
            self.scheduler.set_audio(slot, audio.num_samples, audio.finished)

    def _mark_done(self, stream: Stream) -> None:
        if stream.phase is Phase.ACTIVE:
            stream.phase = Phase.DONE
            self.scheduler.release(stream.slot)
            self._to_release.append(stream)

    def _features(self, streams: list[Stream], group: Group) -> torch.Tensor:
        """[B, F, W] new frames for the group; final short chunks are computed apart and padded."""
        return self.features.compute_group([s.audio for s in streams], group.t0.tolist(), group.widths)

    def _step(self, group: Group) -> None:
        t_start = time.perf_counter()
        wall_start = time.time()
        self.queue_delay.begin_step(wall_start)
        slots = group.slots.tolist()
        by_slot = self.slots.by_slot
        streams = [by_slot[slot] for slot in slots]
        widths = group.widths.tolist()
        # Rows as numpy: the stepper stages them (pinned, non-blocking) and gathers the rows'
        # languages on the device (languages None); the step's one wait is its results copy.
        batch = StepBatch(group.slots, self._features(streams, group), widths, group.is_first, None,
                          group.context_right, self.token_confidence)  # fmt: skip
        result = run_step(self.model, self.encoder, self.pool, batch)
        self.scheduler.advance(group)
        elapsed = time.perf_counter() - t_start
        wall_done = wall_start + elapsed
        self.stats.steps += 1
        self.stats.stream_steps += len(slots)
        self.stats.audio_s += sum(widths) * self.hop_s
        per_mode = self.stats.by_mode.setdefault(group.context_right, [0, 0])
        per_mode[0] += 1
        per_mode[1] += len(slots)
        self._steps.append(StepStats(len(slots), elapsed, group.context_right))
        next_frames = (group.t0 + group.widths).tolist()
        confs = result.token_confidences or [None] * len(streams)
        longest_delay = 0.0
        for s, next_frame, last, ids, frames, decoded, conf, width in zip(
            streams, next_frames, group.is_last.tolist(), result.token_ids, result.token_frames, result.decoded_frames,
            confs, widths,
        ):
            arrived = self._advance(s, next_frame, last, ids, frames, decoded, conf)
            # Due: its last sample in, and at most real-time pace after the stream's previous chunk
            # (queue_delay.py). A client ahead of real time is not the engine falling behind.
            s.due = max(arrived, s.due + width * self.hop_s)
            longest_delay = max(longest_delay, wall_start - s.due)
        self.queue_delay.record(longest_delay, wall_done)

    def _advance(self, s: Stream, next_frame: int, is_last: bool, ids: list[int], frames: list[int], decoded: int,
                 conf: list[float] | None = None) -> float:  # fmt: skip
        """Take one stepped chunk's results; returns the arrival time of the last sample it needed."""
        s.decoded_frames = decoded
        s.add_tokens(frames)
        audio = s.audio
        audio.discard_before(self.features.first_sample_needed(next_frame - self.geometry.pre_cache_frames))
        sample_end = min(self.features.last_sample_needed(next_frame), audio.num_samples)
        arrival = audio.arrival_time(sample_end)
        if is_last:
            arrival = max(arrival, audio.finish_time or arrival)
            self._publish_final(s, ids, frames, arrival, done=True, conf=conf)
            self._mark_done(s)
        elif s.endpoint.is_endpoint(decoded):
            self._publish_final(s, ids, frames, arrival, done=False, conf=conf)
        else:
            self._updates.append(s.update(ids, frames, False, arrival, next_frame * self.hop_s, confidences=conf))
            self._update_slots.append(s.slot)
        return arrival

    def _publish_final(self, s: Stream, ids: list[int], frames: list[int], arrival: float, done: bool,
                       conf: list[float] | None = None) -> None:  # fmt: skip
        processed_s = int(self.scheduler.next_frame[s.slot]) * self.hop_s  # the scheduler's: stepped already
        self._updates.append(s.update(ids, frames, True, arrival, processed_s, done=done, confidences=conf))
        self._update_slots.append(s.slot)
        s.final_sent = done
        s.close_segment()

    def _release_finished(self) -> None:
        done, self._to_release = self._to_release, []
        for s in done:
            if s.abort_reason is None and not s.final_sent:
                # Input ended on a tail too short to encode: the consumer is still owed its final.
                self._publish_final(s, [], [], s.audio.finish_time or time.time(), done=True)
            self.pool.close_row(s.slot)
            if s.biasing_id != NO_BIASING:
                self.pool.biasing.release(s.biasing_id)
            with self._admission:
                self.slots.give_back(s)
                self._num_phrases -= len(s.phrases.phrases) if s.phrases else 0
            self._released.append(ReleasedStream(s.stream_id, s.slot))


def _assembling(on_result: Callable[[StreamResult], None], detok: Detokenizer, frame_s: float):
    assemble = ResultAssembler(detok, frame_s)
    return lambda update: on_result(assemble(update))
