"""Collecting a launched step: each row's tokens, arrival time, endpoint and update, and the
queue delay, with the per-row Python kept to what a row's update needs.

What is array work over the group (numpy, once per step) instead of Python per row:
- positions: the next chunk's first frame, the end of the samples the chunk read, the chunk's
  real-time length and the audio processed;
- arrival times: the usual row's last needed sample is in the last packet its stream took in, so
  its arrival time is that packet's (`LastPacket`, kept by the intake as arrays); only the other
  rows search their buffer's packet list (AudioBuffer.arrival_time, the same answer);
- due times and the queue delay (queue_delay.py), per slot;
- endpoints: a row's rules are evaluated only where its decoded frames reached the detector's
  `fires_at` (engine/endpoint.py), so a row without tokens costs one comparison.
The buffer trim moved to the intake (AudioBuffer.extend's `keep_from`): space is wanted only there.
Rows with rarer work (an EOU model's tokens, a stream's last chunk) take the full per-row path
(engine/publish.py `_advance`). Mixed into `Engine` (engine/loop.py), on the thread that owns it.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .forced_ends import closes_speech
from .in_flight import InFlightStep
from .results import StreamUpdate
from .scheduler import Group
from .outputs import StepStats
from .stream import Stream

log = logging.getLogger(__name__)

class LastPacket:
    """Per slot: where the last packet taken in started (in samples) and when it arrived; the
    intake writes both as arrays (Engine.take_audio_many). A slot with no packet yet has an
    unreachable start, so its rows search their buffer (which then says "now", as before)."""

    NONE = np.iinfo(np.int64).max

    def __init__(self, num_slots: int) -> None:
        self.start = np.full(num_slots, self.NONE, np.int64)  # [S] first sample of the last packet
        self.time = np.zeros(num_slots, np.float64)  # [S] its arrival (server time.time())

    def open(self, slot: int) -> None:
        self.start[slot] = self.NONE

    def took(self, slots, starts, times) -> None:
        """Packets of samples [starts, the slots' new ends) arrived at `times` (equal-length arrays
        or scalars); empty packets must be left out (the buffer records no arrival for them)."""
        self.start[slots] = starts
        self.time[slots] = times

    def arrivals(self, slots: np.ndarray, sample_ends: np.ndarray) -> tuple[list[float], list[bool]]:
        """Arrival of sample `sample_ends - 1` where it lies in the slot's last packet (or past its
        end: the latest one, as AudioBuffer.arrival_time), and which rows that answers."""
        known = sample_ends > self.start[slots]
        return self.time[slots].tolist(), known.tolist()


class CollectMixin:
    """Engine's collect (module docstring)."""

    def _collect(self, step: InFlightStep) -> None:
        result = self.runner.collect(step.launched)
        group, streams, wall_start = step.group, step.streams, step.wall_started
        self.in_flight.landed(step)
        slots = group.slots
        elapsed = time.perf_counter() - step.started
        self._count_step(group, len(slots), group.widths.tolist(), elapsed)
        next_frames = group.t0 + group.widths
        read_end = self.features.last_sample_needed(next_frames)
        arrivals, known = self.last_packet.arrivals(slots, read_end)
        # int64 * float64: Python's int * float, value for value; Python's round, as Stream.update.
        processed = [round(x, 3) for x in (next_frames * self.hop_s).tolist()]
        kept = self._collect_rows(group, streams, result, next_frames.tolist(), read_end.tolist(), arrivals, known,
                                  processed)  # fmt: skip
        # Due: its last sample in, and at most real-time pace after the stream's previous chunk
        # (queue_delay.py). A client ahead of real time is not the engine falling behind.
        rows = slots if kept is None else slots[kept]
        arrived = np.asarray(arrivals) if kept is None else np.asarray(arrivals)[kept]
        due = np.maximum(arrived, self._due[rows] + (group.widths if kept is None else group.widths[kept]) * self.hop_s)
        self._due[rows] = due
        longest_delay = max(0.0, float((wall_start - due).max())) if len(due) else 0.0
        self.queue_delay.record(longest_delay, wall_start + elapsed)

    def _collect_rows(self, group: Group, streams: list[Stream], result, next_frames: list[int], read_end: list[int],
                      arrivals: list[float], known: list[bool], processed: list[float]) -> list[int] | None:  # fmt: skip
        """Each row's update or final; fills `arrivals` where `known` is False (and at last
        chunks); returns the rows kept (None: all), those whose stream is still the slot's."""
        deferred = self.in_flight.has_deferred()  # an abort or forced final deferred to this collect: rare
        by_slot, updates, update_slots = self.slots.by_slot, self._updates, self._update_slots
        slow = self._has_eou or bool(group.is_last.any())
        # Confidences are computed for an EOU model's probability even without --word-confidence;
        # only the full path (_advance) reads them then.
        confs = result.token_confidences if self.token_confidence or slow else None
        dropped = []
        forced = self._forced_rows(group, streams)  # {row: segment before the step}: usually empty
        for i, (s, slot, ids, frames, decoded) in enumerate(
            zip(streams, group.slots.tolist(), result.token_ids, result.token_frames, result.decoded_frames)
        ):
            if by_slot[slot] is not s or (deferred and self._collect_row_aborted(s, slot)):
                dropped.append(i)  # no longer the slot's stream (slots.holds), or aborted while in flight
                continue
            if not known[i]:
                audio = s.audio
                arrivals[i] = audio.arrival_time(min(read_end[i], audio.num_samples))
            conf = confs[i] if confs is not None else None
            if slow:
                arrivals[i] = self._advance(s, next_frames[i], bool(group.is_last[i]), ids, frames, decoded, conf,
                                            arrivals[i])  # fmt: skip
            else:  # _advance without its EOU and last-chunk branches, inlined (every row, every step)
                s.decoded_frames = decoded
                endpoint = s.endpoint
                if frames:
                    endpoint.on_tokens(frames)
                if decoded >= endpoint.fires_at:
                    self._publish_final(s, ids, frames, arrivals[i], done=False, conf=conf,
                                        reason=endpoint.is_endpoint(decoded))  # fmt: skip
                else:
                    updates.append(StreamUpdate(s.stream_id, s.segment, False, False, ids, frames,
                                                endpoint.segment_start_frame, processed[i], arrivals[i],
                                                new_token_confidences=conf))  # fmt: skip
                    update_slots.append(slot)
            if deferred and self.in_flight.pop_final(slot) and self.slots.holds(s):  # not released by its last chunk
                self._publish_final(s, [], [], time.time(), done=False)
        for i, segment in forced.items():
            self._forced_end(streams[i], int(group.slots[i]), segment, next_frames[i], arrivals[i])
        if not dropped:
            return None
        return sorted(set(range(len(streams))) - set(dropped))

    def _forced_rows(self, group: Group, streams: list[Stream]) -> dict[int, int]:
        """Rows whose step reaches their positional forced final (engine/forced_ends.py), with
        their segment before the step: one array comparison over the group."""
        due = np.flatnonzero(self.forced_ends.due(group.slots, group.t0 + group.widths)).tolist()
        return {i: streams[i].segment for i in due}

    def _forced_end(self, s: Stream, slot: int, segment: int, reached_frame: int, arrival: float) -> None:
        """A positional forced final, after the step that reached it: its segment ends here
        unless the step ended it already (an endpoint, an EOU token, a forced final deferred
        to this collect: one final ends it, not a second empty one), an earlier final ended the
        speech and nothing was said since (forced_ends.closes_speech), or the stream is gone."""
        if self.slots.by_slot[slot] is not s or not self.slots.holds(s):
            return  # released by its last chunk, or aborted: its targets were cleared with it
        self.forced_ends.take(slot, reached_frame)
        if s.segment == segment and closes_speech(s.segment, s.endpoint.has_text):
            self._publish_final(s, [], [], arrival, done=False)

    def _collect_row_aborted(self, s: Stream, slot: int) -> bool:
        """A row whose stream is no longer the slot's or was aborted while in flight: its results
        are dropped (by identity, the slot may be another stream's), a pending abort released now."""
        if not self.slots.holds(s):
            return True
        reason = self.in_flight.pop_abort(slot)
        if reason is None:
            return False
        log.debug("stream %s aborted: %s", s.stream_id, reason)
        self._release(s, aborted=True)
        return True

    def _count_step(self, group: Group, num_rows: int, widths: list[int], elapsed: float) -> None:
        self.stats.steps += 1
        self.stats.stream_steps += num_rows
        self.stats.audio_s += sum(widths) * self.hop_s
        per_mode = self.stats.by_mode.setdefault(group.context_right, [0, 0])
        per_mode[0] += 1
        per_mode[1] += num_rows
        self._steps.append(StepStats(num_rows, elapsed, group.context_right))
