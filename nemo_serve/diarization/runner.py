"""Streaming Sortformer as an engine model runner (engine/runner.py): its own slots, chunking and step.

One owner: `SortformerRunner` owns the diarized streams' audio copies, chunk positions and speaker
probabilities, and (through `SpeakerCacheSlots`) their speaker caches; only the engine's loop
thread calls it. Streams that did not ask for speakers never reach it.

Chunking is NeMo's `streaming_feat_loader` grid on live audio: chunk k reports feature frames
[k*C, k*C + C) and reads L frames of left and R of right context (C, L, R: chunk_len,
chunk_left_context, chunk_right_context times the subsampling factor). A chunk is ready once every
frame up to its right context is final (engine/frontend.py's readiness rule); once the input has
ended, the stream's feature count T is known and the last chunks are cut short as NeMo cuts them
(`end = min(stt + C, T)`, `right = min(R, T - end)`). So each stream gets exactly the chunks NeMo's
loop gets on the whole file, and its speaker probabilities equal NeMo's loop on that stream alone
(tests/test_diarization_engine.py). The runner keeps its own copy of the audio: its look-ahead
differs from the ASR model's, and the ASR side drops samples it no longer needs.

Features are computed per step for the rows' chunks only (engine/frontend.py FeatureExtractor on the
diarizer's own preprocessor): equal to the whole-file features, as for the ASR model. Where the
diarizer's preprocessor is the ASR model's (diarization/shared_features.py), the engine hands each
diarized stream's ASR frames over as it computes them (`take_asr_features`) and a chunk waits until
the ASR side has computed its frames, so the preprocessor runs once per frame, not twice; once the
ASR side has stopped for the stream (`asr_stopped`: its last chunk launched, or the stream released
on a tail it does not encode) the diarizer computes what is still missing itself, from its copy of
the audio. The wait delays a chunk by at most one ASR chunk; the speakers are for the ASR's tokens,
which come no earlier than the ASR step that computed the frames.

Launch, then collect, as the ASR steps (engine/loop.py): `launch` decides the step on the host
(diarization/step.py plan_step: no device read) and enqueues it; a stream's chunk position moves on
at launch, so its next chunk can be planned while this one runs (the device runs steps in launch
order). `collect` waits for a step and appends its rows' probabilities; only collected frames answer
`speaker_at`, and a stream is done once its last chunk is collected. A stream closed while its step
is in flight (an abort) gets nothing from that step: rows go to the stream they were launched for,
by identity.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..engine.frontend import AudioBuffer, FeatureExtractor
from .features import KeptFeatures
from .reference import FeatureChunk
from .shared_features import feature_differences
from .slots import NoFreeSlot, SpeakerCacheSlots
from .step import DiarStepBatch, make_batch, plan_step, run_step

log = logging.getLogger("nemo_serve.diarization")


class SpeakerWindow:
    """A stream's speaker probabilities from the first frame still needed to the last reported:
    [first_frame, num_frames). Appends land in spare rows; forgotten rows are dropped by moving
    the kept ones to the front only when the spare rows run out, so a step costs its own frames
    (amortised) and its memory stays under four times the most frames kept at once, however long the stream. The
    rejected alternative, one array concatenated per step, copied the whole history each step."""

    def __init__(self, num_speakers: int, capacity: int = 64) -> None:
        self._rows = np.zeros((capacity, num_speakers), np.float32)  # [capacity, K]
        self._lo = self._hi = 0  # kept rows: _rows[_lo:_hi]
        self.first_frame = 0  # the stream's frame held in _rows[_lo]

    @property
    def num_frames(self) -> int:
        """Diarizer frames reported so far (the forgotten ones included)."""
        return self.first_frame + self._hi - self._lo

    @property
    def capacity(self) -> int:
        return len(self._rows)

    def kept(self) -> np.ndarray:
        """[frames, K] the kept rows, from `first_frame` (a view)."""
        return self._rows[self._lo : self._hi]

    def append(self, preds: np.ndarray) -> None:
        n, kept = len(preds), self._hi - self._lo
        if self._hi + n > len(self._rows):
            if kept + n > len(self._rows) // 2:  # compact to at most half full, or grow
                grown = np.zeros((max(2 * len(self._rows), 2 * (kept + n)), self._rows.shape[1]), np.float32)
                grown[:kept], self._rows = self._rows[self._lo : self._hi], grown
            else:
                self._rows[:kept] = self._rows[self._lo : self._hi]
            self._lo, self._hi = 0, kept
        self._rows[self._hi : self._hi + n] = preds
        self._hi += n

    def forget_before(self, frame: int) -> None:
        """Drop the rows before `frame`, always keeping the last (a finished stream's late tokens read it)."""
        drop = min(frame - self.first_frame, self._hi - self._lo - 1)
        if drop > 0:
            self._lo += drop
            self.first_frame += drop

    def row(self, frame: int) -> np.ndarray:
        """[K] the probabilities of a reported frame. One already forgotten should not be asked for
        (the attacher forgets only before its earliest need); if it is, the oldest kept frame
        answers, logged: a wrong speaker on one token, where an assertion would fail every stream
        of the engine core."""
        assert frame < self.num_frames, (frame, self.num_frames)
        if frame < self.first_frame:
            log.warning("speaker of forgotten frame %d asked for; frame %d answers", frame, self.first_frame)
            frame = self.first_frame
        return self._rows[self._lo + frame - self.first_frame]


@dataclass
class DiarStream:
    """One diarized stream's chunk position and the speaker probabilities still needed."""

    stream_id: str
    max_speakers: int
    preds: SpeakerWindow
    audio: AudioBuffer = field(default_factory=AudioBuffer)
    features: KeptFeatures = field(default_factory=KeptFeatures)  # frames computed and still needed
    next_start: int = 0  # feature frame where its next chunk to launch starts (moved on at launch)
    collected_end: int = 0  # feature frame its collected chunks reach
    asr_stopped: bool = False  # the ASR side computes no more of its frames (shared features only)
    done: bool = False  # every chunk of its (ended) input stepped and collected

    @property
    def num_frames(self) -> int:
        """Diarizer frames whose speaker probabilities are known."""
        return self.preds.num_frames


@dataclass
class DiarPlan:
    """The rows of one step: which streams, and the chunk each steps."""

    stream_ids: list[str]
    chunks: list[FeatureChunk]
    ends: list[int]  # feature frame each row's chunk ends at (its next start)


@dataclass
class DiarLaunched:
    """A step enqueued and not yet collected."""

    plan: DiarPlan
    streams: list[DiarStream]  # the rows' streams, by identity (a stream closed meanwhile gets nothing)
    result: Any  # .result() -> DiarStepResult, waiting for the device


class InlineDevice:
    """How a step runs: called at once. On a GPU the call only enqueues kernels (the step reads
    nothing back), so it returns before the device is done; collect's read of the probabilities is
    the wait. Tests put a thread in its place (tests/test_diarization_overlap.py)."""

    def submit(self, fn, *args) -> "_Done":
        return _Done(fn(*args))


@dataclass
class _Done:
    value: Any

    def result(self) -> Any:
        return self.value


class SortformerRunner:
    """The diarizer in the engine core's loop (module docstring)."""

    def __init__(self, model, num_slots: int) -> None:
        modules = model.sortformer_modules
        self.model = model
        self.pool = SpeakerCacheSlots.for_model(model, num_slots)
        self.featurizer = fb = model.preprocessor.featurizer
        self.features = FeatureExtractor(model.preprocessor, fb.hop_length, fb.n_fft, model.device)
        sub = modules.subsampling_factor
        self.chunk_frames = modules.chunk_len * sub
        self.left_frames = modules.chunk_left_context * sub
        self.right_frames = modules.chunk_right_context * sub
        self.sample_rate = int(model.preprocessor._cfg.sample_rate)
        self.frame_s = sub * fb.hop_length / self.sample_rate  # one diarizer frame (80 ms)
        self.num_speakers = modules.n_spk
        self.streams: dict[str, DiarStream] = {}  # stream_id -> its state, while open
        self.reuse_features = True  # False: each chunk's whole window computed (benchmarks' before)
        self.device = InlineDevice()  # runs (enqueues) the launched steps, in order
        self.in_flight: list[DiarLaunched] = []  # launched, not collected, oldest first
        self.num_steps = 0  # steps run (tests: a server with only plain streams runs none)
        self.seconds = 0.0  # time in plan, step and collect (the loop adds it up; benchmarks read it)
        self.feature_seconds = 0.0  # of which in the preprocessor (benchmarks: the reuse's before/after)
        self.shares_asr_features = False  # frames from the ASR side (share_features_with)

    # ------------------------------------------------------------------ streams
    def open(self, stream_id: str, max_speakers: int) -> None:
        self.pool.acquire(stream_id)  # NoFreeSlot, ValueError for an id already open
        self.streams[stream_id] = DiarStream(stream_id, max_speakers, SpeakerWindow(self.num_speakers))

    def check_open(self, stream_id: str) -> None:
        """ValueError / NoFreeSlot where `open` would refuse the stream, before the engine takes any
        of its slots: an id still held here (a stream whose ASR side ended, waiting for its
        speakers: the engine's slot table no longer has it), or no free diarizer slot."""
        if stream_id in self.pool.stream_to_slot:
            raise ValueError(f"stream id {stream_id!r} is still open on the diarizer (its speakers are not out yet)")
        if not self.pool.num_free:
            raise NoFreeSlot(f"all {self.pool.num_slots} diarization slots are in use")

    def close(self, stream_id: str) -> None:
        """Idempotent."""
        self.streams.pop(stream_id, None)
        self.pool.release(stream_id)

    def take_audio(self, stream_id: str, parts: tuple[np.ndarray, ...], arrived: float) -> None:
        self.streams[stream_id].audio.extend(parts, arrived)

    def finish(self, stream_id: str) -> None:
        if (s := self.streams.get(stream_id)) is not None:
            s.audio.finish()
            self._mark_done(s)

    def share_features_with(self, asr_preprocessor: torch.nn.Module) -> list[str]:
        """Take feature frames from the ASR side if its preprocessor is the diarizer's (module
        docstring); returns what differs (empty: shared)."""
        differences = feature_differences(asr_preprocessor, self.model.preprocessor)
        self.shares_asr_features = not differences
        log.info("diarizer features: %s", "the ASR model's" if not differences else "its own (" + "; ".join(differences) + ")")
        return differences

    def take_asr_features(self, stream_ids: list[str | None], t0s: np.ndarray, widths: np.ndarray,
                          last: np.ndarray, feats: torch.Tensor) -> None:  # fmt: skip
        """One ASR step's frames: row i's [t0s[i], t0s[i] + widths[i]) of `feats` [B, F, W] for the
        diarized stream `stream_ids[i]` (None: a plain row); `last[i]`: the stream's last ASR chunk."""
        whole = None not in stream_ids  # every row diarized: views of the step's frames keep nothing extra alive
        for row, stream_id in enumerate(stream_ids):
            if (s := self.streams.get(stream_id)) is None:  # a plain row (an open diarized stream is always here:
                continue  # Engine.check_accounting), skipped rather than failing the core's loop
            frames = feats[row, :, : int(widths[row])]
            # A gap (never seen: the ASR's frames are consecutive) is refused; the runner computes it.
            s.features.add(int(t0s[row]), frames if whole else frames.clone())
            s.asr_stopped |= bool(last[row])

    def asr_stopped(self, stream_id: str) -> None:
        """The ASR side will compute no more frames for the stream: the rest are computed here."""
        if (s := self.streams.get(stream_id)) is not None:
            s.asr_stopped = True

    def problems(self) -> list[str]:
        """What disagrees in the diarizer's books (Engine.check_accounting): its slot pool holds
        exactly the open streams, each on its own slot, none of them also free."""
        found, held = self.pool.problems(), set(self.pool.stream_to_slot)
        if held != set(self.streams):
            found.append(f"diarizer slots held by {sorted(held - set(self.streams))} with no diarizer stream, "
                         f"diarizer streams {sorted(set(self.streams) - held)} without a slot")  # fmt: skip
        return found

    # ------------------------------------------------------------------ one step
    def plan(self) -> DiarPlan | None:
        """Every stream whose next chunk is ready, one chunk each (a row's next chunk needs this
        one's state), or None. Python per diarized stream: diarized streams are few beside the
        plain ones, and a plain stream costs nothing here. Features: only the frames no earlier
        chunk computed (diarization/features.py), one preprocessor call per distinct count."""
        cuts = [(s, cut) for s in self.streams.values() if (cut := self._next_cut(s)) is not None]
        if not cuts:
            return None
        chunks = self._chunk_features([s for s, _ in cuts], [cut[0] for _, cut in cuts], [cut[1] for _, cut in cuts])
        chunks = [FeatureChunk(f, cut[2], cut[3]) for f, (_, cut) in zip(chunks, cuts)]
        return DiarPlan([s.stream_id for s, _ in cuts], chunks, [cut[4] for _, cut in cuts])

    def _chunk_features(self, streams: list[DiarStream], t0s: list[int], ns: list[int]) -> list[torch.Tensor]:
        """Each row's frames [t0, t0 + n) as [n, F]: the ones computed before reused."""
        if not self.reuse_features:
            for s in streams:
                s.features = KeptFeatures()
        starts = [s.features.missing_from(t0) for s, t0 in zip(streams, t0s)]
        counts = np.array([t0 + n - start for t0, n, start in zip(t0s, ns, starts)])
        new: list[torch.Tensor | None] = [None] * len(streams)
        for count in np.unique(counts[counts > 0]).tolist():
            rows = np.flatnonzero(counts == count).tolist()
            started = time.perf_counter()
            feats = self.features.compute([streams[r].audio for r in rows], [starts[r] for r in rows], count)
            self.feature_seconds += time.perf_counter() - started
            for k, r in enumerate(rows):
                new[r] = feats[k]  # [F, count]
        return [s.features.window(t0, n, x) for s, t0, n, x in zip(streams, t0s, ns, new)]

    def launch(self, plan: DiarPlan) -> DiarLaunched:
        """Decides the step on the host and enqueues it (module docstring); its rows' chunk
        positions move on now."""
        slots = [self.pool.stream_to_slot[i] for i in plan.stream_ids]
        batch: DiarStepBatch = make_batch(slots, plan.chunks, self.model.device)
        step_plan = plan_step(self.model, self.pool, batch)  # on this thread: the host fill levels are its
        streams = [self.streams[i] for i in plan.stream_ids]
        for s, end in zip(streams, plan.ends):
            s.next_start = end
            s.audio.discard_before(self.features.first_sample_needed(end - self.left_frames))
        launched = DiarLaunched(plan, streams, self.device.submit(run_step, self.model, self.pool, batch, step_plan))
        self.in_flight.append(launched)
        self.num_steps += 1
        return launched

    def collect(self, launched: DiarLaunched) -> list[str]:
        """Waits for the step; each row's new speaker probabilities appended to its stream (if
        still open); returns the rows' stream ids."""
        result = launched.result.result()
        preds = result.chunk_preds.float().cpu().numpy()  # the wait for the device
        lengths = result.chunk_lengths.tolist()
        self.in_flight.remove(launched)
        for row, (s, end) in enumerate(zip(launched.streams, launched.plan.ends)):
            if self.streams.get(s.stream_id) is not s:
                continue  # closed while in flight
            s.preds.append(preds[row, : lengths[row]])  # the attacher forgets what it no longer needs
            s.collected_end = end
            self._mark_done(s)
        return launched.plan.stream_ids

    def collect_all_but(self, keep: int) -> None:
        """Collect the steps in flight, oldest first, leaving the newest `keep`."""
        while len(self.in_flight) > keep:
            self.collect(self.in_flight[0])

    def _next_cut(self, s: DiarStream) -> tuple[int, int, int, int, int] | None:
        """The stream's next chunk as NeMo's loader cuts it (module docstring): (first feature
        frame read, frames read, left context, right context, end of the reported frames), or None."""
        audio, stt = s.audio, s.next_start
        available = self._final_frames(audio) if audio.finished else self.features.frames_available(audio)
        if s.done or (audio.finished and stt >= available):  # every chunk launched
            return None
        if audio.finished:
            end = min(stt + self.chunk_frames, available)
            right = min(self.right_frames, available - end)
        elif stt + self.chunk_frames + self.right_frames <= available:
            end, right = stt + self.chunk_frames, self.right_frames
        else:
            return None
        left = min(self.left_frames, stt)
        if self.shares_asr_features and not s.asr_stopped and s.features.end_frame < end + right:
            return None  # its frames come from the ASR side's next steps
        return stt - left, end + right - stt + left, left, right, end

    def _mark_done(self, s: DiarStream) -> None:
        if s.audio.finished and s.collected_end >= self._final_frames(s.audio):
            s.done = True

    def _final_frames(self, audio: AudioBuffer) -> int:
        """An ended stream's feature count as NeMo's diarizer has it: the preprocessor's length,
        one short of the frames the STFT makes (NeMo crops its masked last frame, `forward`)."""
        return int(self.featurizer.get_seq_len(torch.tensor([audio.num_samples])).item())

    # ------------------------------------------------------------------ speakers for the ASR's tokens
    def speaker_at(self, stream_id: str, time_s: float) -> int | None:
        """The most probable of the stream's first max_speakers speakers at `time_s`, or None while
        the diarizer has not reached that time (past the end of a finished stream: its last frame)."""
        s = self.streams[stream_id]
        frame = self.frame_at(time_s)
        if frame >= s.num_frames:
            if not s.done or not s.num_frames:
                return None
            frame = s.num_frames - 1
        return int(np.argmax(s.preds.row(frame)[: s.max_speakers]))

    def latest_speaker(self, stream_id: str) -> int | None:
        """The most probable speaker at the last frame reported, or None before the first chunk."""
        s = self.streams[stream_id]
        return int(np.argmax(s.preds.row(s.num_frames - 1)[: s.max_speakers])) if s.num_frames else None

    def frame_at(self, time_s: float) -> int:
        return int(time_s / self.frame_s + 1e-6)

    def forget_before(self, stream_id: str, time_s: float) -> None:
        """No token before `time_s` will be asked about: its frames' probabilities go."""
        self.streams[stream_id].preds.forget_before(self.frame_at(time_s))

    def is_done(self, stream_id: str) -> bool:
        return self.streams[stream_id].done

    def probabilities(self, stream_id: str) -> np.ndarray:
        """[frames, K] the stream's speaker probabilities still kept (from preds.first_frame)."""
        return self.streams[stream_id].preds.kept()
