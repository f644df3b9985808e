"""The engine: one owner of the model, its slots and its streams, driven by one thread.

  admit / take_audio / finish      act at once: a stream's slot, cache row and scheduler row
  force_final / abort                open together; audio goes into its buffer and the scheduler;
                                     a forced final or an abort is published and released now
  iterate()                      ->  1 scheduler.plan: readiness and grouping as array operations
                                       over the open slots not in flight (by mode, first | later
                                       chunks), earliest deadline first
                                     2 launch: features + one batched step per group, staged and
                                       enqueued; the chunks count as stepped (scheduler.advance)
                                     3 collect the steps launched before: results and endpoints;
                                       finished streams released
                                   <-  IterationOutput: everything produced since the last one

Launch, then collect (vLLM v1's `step_with_batch_queue`; engine/step.py). With `overlap` on
(NEMO_SERVE_OVERLAP=1; off by default until a GPU run has checked it) an iteration launches step
N+1 before it waits for step N, so the host plans, computes features, stages and publishes while
the device runs. A slot in flight is left out of
planning until its step is collected (its next chunk needs this one's caches); an abort or a forced
final of a stream in flight is applied when its step is collected, so its results are dropped, or
land before the forced final, as the sequential loop would have it. With `overlap` off (the
default; on a CPU the device work is done at launch anyway, nothing to overlap) each step is
collected as soon as it is launched: the sequential loop, result for result.

Every method is for the thread that owns the engine: the thread that steps the engine core
(core/engine_core.py), in its process (core/core_proc.py) or in this one (core/inproc.py), which
hands it the calls other threads make. So there are no locks, queues or wake-ups here, and a stream is never half admitted or half
released between two calls: whether it is open is the slot table's alone (engine/slot_table.py).

`iterate()` returns what it produced (engine/outputs.py) and calls nobody back: whoever drives it
routes the updates, frees the released slots on its side and records the step statistics.

Nobody configures a batch size: the streams that became ready while the previous step ran
form the next batch (capped at max_batch). Nothing waits to fill a batch.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .accounting import AccountingMixin
from .admission import AdmissionMixin
from .collect import CollectMixin, LastPacket
from .phrases import PhraseLimits, encodable_characters
from .encoder import make_encoder
from .ring_cache import make_slot_pool
from .endpoint import EndpointConfig
from .eou import EouTokens
from .forced_ends import ForcedEnds
from .frontend import AudioArena, FeatureExtractor
from .publish import PublishMixin
from .scheduler import Group, Scheduler
from .outputs import IterationOutput, ReleasedStream, StepStats
from .geometry import ModelInfo
from .queue_delay import QueueDelay
from .slot_table import SlotTable
from .runner import RnntRunner
from .speakers import SpeakerAttacher
from .step import StepBatch, prepare_step
from .in_flight import InFlight, InFlightStep
from .results import Detokenizer, StreamUpdate
from .stream import Stream

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


class Engine(AdmissionMixin, AccountingMixin, CollectMixin, PublishMixin):
    """Streams in, results out, on the thread that owns it (module docstring). Its methods by job:
    streams in and their release (engine/admission.py), what it holds and the accounting check
    (engine/accounting.py), collecting a step (engine/collect.py), a collected step's updates and
    finals and the diarizer (engine/publish.py); here start-up and the iteration: plan, launch, collect."""

    def __init__(
        self,
        model,
        num_slots: int = 64,
        max_batch: int | None = None,
        endpoint: EndpointConfig = EndpointConfig(),
        kv_cache: bool = True,
        token_confidence: bool = False,
        phrase_limits: PhraseLimits = PhraseLimits(),
        overlap: bool | None = None,
        diarizer=None,
    ) -> None:
        """`kv_cache`: cache projected keys/values (engine/encoder.py) where the architecture
        allows; False runs NeMo's own layer code (caches layer inputs). `token_confidence`: each
        new token comes with the decoder's confidence (engine/step.py), for word confidences.
        `overlap`: launch step N+1 before collecting step N (module docstring); None: as
        NEMO_SERVE_OVERLAP says (off unless 1). `diarizer`: a streaming Sortformer (NeMo
        SortformerEncLabelModel, its streaming settings applied) for streams that ask for speakers."""
        self.model = model
        self.geometry = model.geometry
        self.num_slots = num_slots
        self.max_batch = max_batch or num_slots
        self.endpoint = endpoint
        # The ASR model's slots and step (engine/runner.py); `encoder` and `pool` are its.
        encoder = make_encoder(model, kv_cache=kv_cache)
        self.runner = RnntRunner(model, encoder, make_slot_pool(model, encoder, num_slots))
        # The second runner, for diarized streams only, and their results waiting for its speakers.
        self.diarizer = self.speakers = None
        if diarizer is not None:
            from ..diarization.runner import SortformerRunner  # NeMo's Sortformer only where one is served

            self.diarizer = SortformerRunner(diarizer, num_slots)
            self.diarizer.share_features_with(model.preprocessor)  # its own preprocessor run where they differ
            self.speakers = SpeakerAttacher(self.diarizer, model.geometry.encoder_frame_s)
        self.token_confidence = token_confidence
        self.eou = EouTokens.from_vocabulary(model.vocabulary)  # empty unless the model has <EOU>/<EOB>
        self._has_eou = bool(self.eou)  # read per row per step
        # An EOU final carries its token's probability: the step computes confidences for an EOU
        # model even without --word-confidence (a log-softmax per label iteration, engine/step.py);
        # clients then get only the EOU probability, not per-token confidences.
        self._step_confidence = token_confidence or bool(self.eou)
        self.phrase_limits = phrase_limits
        self.encodable = encodable_characters(model.vocabulary)
        self._num_phrases = 0  # boosted phrases of the open streams (--max-phrases-total)
        self.features = FeatureExtractor.for_model(model)
        self.audio_arena = AudioArena()  # the streams' sample buffers (engine/frontend.py)
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
            num_speakers=self.diarizer.num_speakers if self.diarizer else None,
        )
        self.stats = EngineStats()
        self.queue_delay = QueueDelay()  # recorded here; the in-process harness reads it from any thread
        self.scheduler = Scheduler(self.geometry, num_slots, self.max_batch, self.features.margin)
        # Which stream holds each slot, hence which streams are open: the one record of it.
        self.slots = SlotTable(num_slots)
        # Per slot, for collect (engine/collect.py): the last packet taken in (where it started,
        # when it arrived) and when the stream's last stepped chunk was due (queue_delay.py).
        self.last_packet = LastPacket(num_slots)
        self._due = np.full(num_slots, -np.inf)
        self.forced_ends = ForcedEnds(num_slots)  # positional forced finals (engine/forced_ends.py)
        # What was produced since the last iterate() returned (admission errors aside, every call
        # that publishes or releases adds here): the next IterationOutput.
        self._updates: list[StreamUpdate] = []
        self._update_slots: list[int] = []  # each update's slot
        self._released: list[ReleasedStream] = []
        self._steps: list[StepStats] = []
        # Off unless NEMO_SERVE_OVERLAP=1, on CUDA too: the overlapped loop is tested on the CPU with a
        # stand-in device only; it becomes CUDA's default once a GPU run shows --selftest N/N with it.
        if overlap is None:
            overlap = os.environ.get("NEMO_SERVE_OVERLAP", "0") == "1"
        self.overlap = overlap
        self.in_flight = InFlight(num_slots)  # steps launched, not collected; calls waiting for them
        # Test hook, never a setting: every step sleeps this long, a model slower than real time on a
        # CPU that is not (tests/test_server_e2e.py overload test). Named TEST so nobody ships it.
        self.test_step_sleep_s = float(os.environ.get("NEMO_SERVE_TEST_STEP_SLEEP_S", "0"))
        if self.test_step_sleep_s:
            log.warning("NEMO_SERVE_TEST_STEP_SLEEP_S=%g: every step sleeps that long (a test hook)", self.test_step_sleep_s)


    # The ASR runner's encoder and slot pool, by their old names (tests swap them for variants).
    @property
    def encoder(self):
        return self.runner.encoder

    @encoder.setter
    def encoder(self, encoder) -> None:
        self.runner.encoder = encoder

    @property
    def pool(self):
        return self.runner.pool

    @pool.setter
    def pool(self, pool) -> None:
        self.runner.pool = pool

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
        steppers = prepare_step(self.model, self.encoder, self.pool, confidence=self._step_confidence)
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

    # ------------------------------------------------------------------ one iteration
    def iterate(self) -> IterationOutput:
        """One pass: plan, launch each group, collect the steps the last call launched (overlap
        off: each at once), publish; returns everything produced since the last call (`.busy`: a
        stream advanced or a step is in flight, so the caller should not sleep)."""
        earlier = self.in_flight.take()
        for group in self._schedule():  # 1
            step = self._launch(group)  # 2
            self.in_flight.launched(step, keep=self.overlap)
            if not self.overlap:
                self._collect(step)  # 3, at once: the sequential loop
        diar_rows = self._launch_diarizer() if self.speakers else 0  # 2b: diarized streams only
        for step in earlier:  # 3: launched by the last call; the device ran them meanwhile
            self._collect(step)
        if self.speakers:
            self._diarize(keep_in_flight=int(self.overlap and diar_rows > 0))  # 4
        out = IterationOutput(tuple(self._updates), tuple(self._update_slots), tuple(self._released), tuple(self._steps),
                              self.queue_delay.published, len(self.in_flight.steps), diar_rows)  # fmt: skip
        self._updates.clear()
        self._update_slots.clear()
        self._released.clear()
        self._steps.clear()
        return out

    def plan(self) -> list[list[Chunk]]:
        """The encoder calls `iterate()` runs next, in order: one list of chunks per batched call.

        Groups the ready streams exactly as `iterate()` does: modes, and first chunks and later
        chunks, never share a call; earliest deadline first, at most `max_batch` chunks, and with
        several modes ready only the earliest-due mode's calls. Runs no model (a stream whose input
        ended on a tail too short to encode gets its final and is released here, as `iterate()`
        would); a second call before `iterate()` returns the same plan unless input arrived in
        between."""
        return [
            [
                Chunk(self.slots.stream_at(slot).stream_id, t0, width, g.is_first, last)
                for slot, t0, width, last in zip(g.slots.tolist(), g.t0.tolist(), g.widths.tolist(), g.is_last.tolist())
            ]
            for g in self._schedule()
        ]

    def _schedule(self) -> list[Group]:
        groups, done = self.scheduler.plan(time.time(), self.slots.held & ~self.in_flight.flying)
        for slot in done.tolist():  # input ended on a tail NeMo's loop would not encode: owed its final
            s = self.slots.stream_at(slot)
            self._publish_final(s, [], [], s.audio.finish_time or time.time(), done=True, reason="end_of_input")
            self._release(s)
        if groups and groups[-1].context_right != groups[0].context_right:
            # Several modes ready: step only the earliest-due mode, then plan again. A long-chunk
            # step cannot be interrupted, so running every mode's groups back to back would make
            # short chunks that become ready meanwhile wait for all of it; planning after each mode
            # lets them go ahead of long-chunk work that still has slack (measured: docs/performance.md,
            # "Mixed latency modes"). The long-chunk groups stay ready and go once they are the
            # earliest due.
            groups = [g for g in groups if g.context_right == groups[0].context_right]
        flying = self.in_flight.flying
        if groups and flying.any() and groups[0].context_right not in set(self.scheduler.mode[flying].tolist()):
            # Another mode's step is in flight: launch nothing until it is collected, then plan
            # again. Launching now would queue a long-chunk step on the device between two steps
            # of short-chunk streams that are due sooner (the rule above, which sees only the
            # streams not in flight); a mode switch costs one iteration without overlap instead.
            return []
        return groups

    def _features(self, streams: list[Stream], group: Group) -> torch.Tensor:
        """[B, F, W] new frames for the group; final short chunks are computed apart and padded.
        A diarizer with the same preprocessor gets its streams' frames from here (diarization/runner.py)."""
        feats = self.features.compute_group([s.audio for s in streams], group.t0.tolist(), group.widths)
        if self.diarizer is not None and self.diarizer.shares_asr_features:
            stream_ids = [s.stream_id if s.diarized else None for s in streams]
            self.diarizer.take_asr_features(stream_ids, group.t0, group.widths, group.is_last, feats)
        return feats

    def _launch(self, group: Group) -> InFlightStep:
        t_start = time.perf_counter()
        wall_start = time.time()
        self.queue_delay.begin_step(wall_start)
        by_slot = self.slots.by_slot
        streams = [by_slot[slot] for slot in group.slots.tolist()]
        # Rows as numpy: the stepper stages them (pinned, non-blocking) and gathers the rows'
        # languages on the device (languages None); the step's one wait is in collect_step.
        batch = StepBatch(group.slots, self._features(streams, group), group.widths.tolist(), group.is_first, None,
                          group.context_right, self._step_confidence)  # fmt: skip
        launched = self.runner.launch(batch)
        if self.test_step_sleep_s:
            time.sleep(self.test_step_sleep_s)
        self.scheduler.advance(group)  # at launch: the next plan must not take these chunks again
        return InFlightStep(group, streams, launched, t_start, wall_start)
