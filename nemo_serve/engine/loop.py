"""The step loop: one thread owns the model and advances every ready stream.

Network side (any thread)            loop thread
  open_stream / push / finish   ->   1 drain inbox (opens, aborts, force-finals)
  abort / force_final                2 absorb audio, find ready streams
                                     3 group them (first chunks | later chunks), oldest first
  on_result(StreamResult)       <-   4 features + one batched step per group
                                     5 publish results, endpoints
                                     6 release finished streams

Nobody configures a batch size: the streams that became ready while the previous step ran
form the next batch (capped at max_batch). Nothing waits to fill a batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .encoder import make_encoder
from .endpoint import EndpointConfig
from .frontend import FeatureExtractor
from .slots import NoFreeSlotError, SlotPool
from .step import StepBatch, run_step
from .stream import Detokenizer, Phase, Stream, StreamResult

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    """The next chunk of one ready stream: its feature frames [t0, t0 + num_frames)."""

    stream: Stream
    t0: int
    num_frames: int
    is_first: bool
    is_last: bool

    @property
    def stream_id(self) -> str:
        return self.stream.stream_id


@dataclass
class EngineStats:
    steps: int = 0
    stream_steps: int = 0
    audio_s: float = 0.0


class Engine:
    """Streams in, results out. All model work happens on the loop thread started by `start()`."""

    def __init__(
        self,
        model,
        num_slots: int = 64,
        max_batch: int | None = None,
        endpoint: EndpointConfig = EndpointConfig(),
        on_step: Callable[[int, float], None] | None = None,
        kv_cache: bool = True,
    ) -> None:
        """`kv_cache`: cache projected keys/values (engine/encoder.py) where the architecture
        allows; False runs NeMo's own layer code (caches layer inputs)."""
        self.model = model
        self.geometry = model.geometry
        self.num_slots = num_slots
        self.max_batch = max_batch or num_slots
        self.endpoint = endpoint
        self.on_step = on_step  # metrics hook: (batch size, seconds)
        self.encoder = make_encoder(model.nemo.encoder, kv_cache=kv_cache)  # loop thread only
        self.pool = SlotPool(model, num_slots, self.encoder.channel_shape)  # loop thread only
        self.features = FeatureExtractor.for_model(model)
        self.detok = Detokenizer(model.vocabulary, model.is_bpe)
        self.hop_s = self.geometry.hop_samples / self.geometry.sample_rate
        self.stats = EngineStats()
        self._streams: dict[str, Stream] = {}  # stream_id -> Stream; loop thread only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # Stream to open, from any thread
        self._admission = threading.Lock()
        self._num_admitted = 0  # streams holding or about to hold a slot (guarded by _admission)
        self._admitted_ids: set[str] = set()  # their stream ids (guarded by _admission)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def summary(self) -> str:
        layout = "keys/values cached" if self.encoder.kind == "kv" else "NeMo layer inputs cached"
        return self.model.summary(self.num_slots, self.pool.cache_bytes_per_stream, layout)

    # ------------------------------------------------------------------ network-side API
    def open_stream(
        self,
        on_result: Callable[[StreamResult], None],
        *,
        stream_id: str | None = None,
        language: str | None = None,
        endpoint: EndpointConfig | None = None,
    ) -> Stream:
        """Admit a stream or raise NoFreeSlotError / ValueError (bad language)."""
        lang = self.model.language_index(language)
        stream_id = stream_id or uuid.uuid4().hex
        with self._admission:
            if stream_id in self._admitted_ids:
                raise ValueError(f"stream id {stream_id!r} is already open")
            if self._num_admitted >= self.num_slots:
                raise NoFreeSlotError(f"all {self.num_slots} slots are in use")
            self._num_admitted += 1
            self._admitted_ids.add(stream_id)
        stream = Stream(
            stream_id=stream_id,
            on_result=on_result,
            language_index=lang,
            endpoint_config=endpoint or self.endpoint,
            frame_s=self.geometry.encoder_frame_s,
        )
        self._inbox.put(stream)
        self._wake.set()
        return stream

    def push(self, stream: Stream, samples: np.ndarray) -> None:
        stream.push(np.asarray(samples, dtype=np.float32).reshape(-1))
        self._wake.set()

    def finish(self, stream: Stream) -> None:
        stream.audio.finish()
        self._wake.set()

    def force_final(self, stream: Stream) -> None:
        stream.request_force_final()
        self._wake.set()

    def abort(self, stream: Stream, reason: str = "aborted") -> None:
        """Drop the stream between steps; no further results are delivered. Idempotent."""
        stream.request_abort(reason)
        self._wake.set()

    @property
    def num_free_slots(self) -> int:
        with self._admission:
            return self.num_slots - self._num_admitted

    @property
    def num_open_streams(self) -> int:
        with self._admission:
            return self._num_admitted

    @property
    def loop_stream_ids(self) -> list[str]:
        """Ids of the streams the step loop holds: taken in from the inbox, not yet released.
        Loop thread only (or an engine that is not started and driven with `iterate()`)."""
        return list(self._streams)

    # ------------------------------------------------------------------ lifecycle
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
        try:
            while not self._stop.is_set():
                if not self.iterate():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - a dead loop must be visible to the server
            log.exception("step loop crashed")
            self.error = e

    # ------------------------------------------------------------------ one iteration
    def iterate(self) -> bool:
        """One pass of the loop; True if any stream advanced (so the caller should not sleep)."""
        groups = self.plan()  # 1, 2, 3
        for group in groups:  # 4, 5
            self._step(group)
        self._release_finished()  # 6
        return bool(groups)

    def plan(self) -> list[list[Chunk]]:
        """The encoder calls `iterate()` runs next, in order: one list of chunks per batched call.

        Takes in newly opened streams, applies aborts and forced finals, absorbs audio (steps 1-2)
        and groups the ready streams (step 3): first chunks and later chunks never share a call,
        oldest-ready first, at most `max_batch` chunks in all. Each chunk gives its stream
        (`stream_id`), width (`num_frames`) and whether it is the stream's first or last. Runs no
        model (a forced final, which needs none, is published here); a second call before
        `iterate()` returns the same plan unless input arrived in between. Loop thread only (or
        an engine that is not started and driven with `iterate()`).
        """
        self._drain_inbox()  # 1
        return self._group(self._ready_chunks())  # 2, 3

    def _drain_inbox(self) -> None:
        while True:
            try:
                stream = self._inbox.get_nowait()
            except queue.Empty:
                break
            stream.slot = self.pool.allocate(stream.stream_id, stream.language_index)
            stream.phase = Phase.ACTIVE
            self._streams[stream.stream_id] = stream
        for stream in self._streams.values():
            if stream.abort_reason is not None and stream.phase is not Phase.DONE:
                stream.phase = Phase.DONE
                stream.on_result = _discard
            elif stream.take_force_final() and stream.phase is Phase.ACTIVE:
                self._publish_final(stream, [], time.time(), done=False)

    def _next_chunk(self, s: Stream) -> Chunk | None:
        g, audio = self.geometry, s.audio
        audio.absorb()
        available = self.features.frames_available(audio)
        if not s.first_chunk_done:
            if available >= g.first_frames:
                return Chunk(s, 0, g.first_frames, True, audio.finished and available == g.first_frames)
            if audio.finished:
                if available >= g.min_first_frames:
                    return Chunk(s, 0, available, True, True)
                s.phase = Phase.DONE  # nothing NeMo's loop would encode
            return None
        remaining = available - s.next_frame
        if remaining >= g.chunk_frames:
            return Chunk(s, s.next_frame, g.chunk_frames, False, audio.finished and remaining == g.chunk_frames)
        if audio.finished:
            # NeMo's loop drops a tail shorter than sampling_frames[1] (8 feature frames).
            if remaining >= g.min_later_frames:
                return Chunk(s, s.next_frame, remaining, False, True)
            s.phase = Phase.DONE
        return None

    def _ready_chunks(self) -> list[Chunk]:
        now = time.time()
        chunks = []
        for s in self._streams.values():
            if s.phase is not Phase.ACTIVE:
                continue
            c = self._next_chunk(s)
            if c is None:
                s.ready_since = 0.0
                continue
            if not s.ready_since:
                s.ready_since = now
            chunks.append(c)
        return chunks

    def _group(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """First chunks and later chunks go in separate calls (different drop); oldest-ready first."""
        chunks.sort(key=lambda c: c.stream.ready_since)
        chunks = chunks[: self.max_batch]
        first = [c for c in chunks if c.is_first]
        later = [c for c in chunks if not c.is_first]
        return [g for g in (first, later) if g]

    def _features(self, group: list[Chunk]) -> torch.Tensor:
        """[B, F, W] new frames for the group; final short chunks are computed apart and padded."""
        width = max(c.num_frames for c in group)
        out = torch.zeros(len(group), self.model.num_mels, width, device=self.model.device)
        by_len: dict[int, list[int]] = {}
        for i, c in enumerate(group):
            by_len.setdefault(c.num_frames, []).append(i)
        for n, idx in by_len.items():
            feats = self.features.compute([group[i].stream.audio for i in idx], [group[i].t0 for i in idx], n)
            out[idx, :, :n] = feats
        return out

    def _step(self, group: list[Chunk]) -> None:
        t_start = time.perf_counter()
        rows = torch.tensor([c.stream.slot for c in group], dtype=torch.long, device=self.model.device)
        langs = None
        if self.model.prompt_dictionary is not None:
            langs = self.pool.languages.index_select(0, rows)
        batch = StepBatch(rows, self._features(group), [c.num_frames for c in group], group[0].is_first, langs)
        result = run_step(self.model, self.encoder, self.pool, batch)
        elapsed = time.perf_counter() - t_start
        self.stats.steps += 1
        self.stats.stream_steps += len(group)
        self.stats.audio_s += sum(c.num_frames for c in group) * self.hop_s
        if self.on_step is not None:
            self.on_step(len(group), elapsed)
        for i, c in enumerate(group):
            self._advance(c, result.token_ids[i], result.token_frames[i], result.decoded_frames[i])

    def _advance(self, c: Chunk, ids: list[int], frames: list[int], decoded: int) -> None:
        s = c.stream
        s.first_chunk_done = True
        s.next_frame = c.t0 + c.num_frames
        s.decoded_frames = decoded
        s.ready_since = 0.0
        s.add_tokens(ids, frames, self.detok)
        audio = s.audio
        audio.discard_before(self.features.first_sample_needed(s.next_frame - self.geometry.pre_cache_frames))
        sample_end = min(self.features.last_sample_needed(s.next_frame), audio.num_samples)
        arrival = audio.arrival_time(sample_end)
        if c.is_last:
            arrival = max(arrival, audio.finish_time or arrival)
            self._publish_final(s, ids, arrival, done=True)
            s.phase = Phase.DONE
        elif s.endpoint.is_endpoint(decoded):
            self._publish_final(s, ids, arrival, done=False)
        else:
            s.on_result(s.result(ids, False, arrival, self.hop_s))

    def _publish_final(self, s: Stream, ids: list[int], arrival: float, done: bool) -> None:
        s.on_result(s.result(ids, True, arrival, self.hop_s, done=done))
        s.final_sent = done
        s.close_segment()

    def _release_finished(self) -> None:
        done = [s for s in self._streams.values() if s.phase is Phase.DONE]
        for s in done:
            if s.abort_reason is None and not s.final_sent:
                # Input ended on a tail too short to encode: the consumer is still owed its final.
                self._publish_final(s, [], s.audio.finish_time or time.time(), done=True)
            self.pool.free(s.stream_id)
            del self._streams[s.stream_id]
            with self._admission:
                self._num_admitted -= 1
                self._admitted_ids.discard(s.stream_id)
        assert self.pool.num_free + self.pool.num_used == self.pool.num_slots


def _discard(_: StreamResult) -> None:
    pass
