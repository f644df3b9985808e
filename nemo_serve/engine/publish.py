"""Publishing a collected step: each row's tokens taken, EOU tokens
cut into finals, endpoint and end-of-input finals, plain updates; and the diarizer's launch and
collect, which hold a diarized stream's updates until their speakers are known
(engine/speakers.py). Mixed into `Engine` (engine/loop.py), whose attributes it uses; called by
its collect (engine/collect.py), on the thread that owns the engine."""

from __future__ import annotations

import time

from .stream import Stream


class PublishMixin:
    """Engine methods that turn a step's results into updates and finals (module docstring)."""

    def _advance(self, s: Stream, next_frame: int, is_last: bool, ids: list[int], frames: list[int], decoded: int,
                 conf: list[float] | None, arrival: float) -> float:  # fmt: skip
        """Take one stepped chunk's results, every case (engine/collect.py inlines the usual one);
        `arrival`: when the last sample the chunk read arrived. Returns it (a last chunk's: the
        end of input's, if later)."""
        s.decoded_frames = decoded
        if self._has_eou:
            ids, frames, conf = self._end_at_eou(s, ids, frames, conf, arrival)
        if not self.token_confidence:
            conf = None  # computed for the EOU probability only
        s.add_tokens(frames)
        if is_last:
            arrival = max(arrival, s.audio.finish_time or arrival)
            self._publish_final(s, ids, frames, arrival, done=True, conf=conf, reason="end_of_input")
            self._release(s)
        elif reason := s.endpoint.is_endpoint(decoded):
            self._publish_final(s, ids, frames, arrival, done=False, conf=conf, reason=reason)
        else:
            self._updates.append(s.update(ids, frames, False, arrival, next_frame * self.hop_s, confidences=conf))
            self._update_slots.append(s.slot)
        return arrival

    def _end_at_eou(self, s: Stream, ids: list[int], frames: list[int], conf: list[float] | None, arrival: float
                    ) -> tuple[list[int], list[int], list[float] | None]:  # fmt: skip
        """An EOU model's tokens: each EOU token closes the segment it ends (a final with its
        reason and probability; the next segment starts after its frame), unless the stream turned
        EOU endings off; either way the token is cut out. Returns the tokens after the last one."""
        if not s.endpoint_config.eou_endings:
            return self.eou.strip(ids, frames, conf)
        cuts, rest = self.eou.split(ids, frames, conf)
        for cut in cuts:
            s.add_tokens(cut.frames)
            self._publish_final(s, cut.ids, cut.frames, arrival, done=False,
                                conf=cut.confidences if self.token_confidence else None, reason=cut.reason,
                                eou_probability=cut.probability, eou_frame=cut.frame, next_start_frame=cut.frame + 1)  # fmt: skip
        return rest

    def _publish_final(self, s: Stream, ids: list[int], frames: list[int], arrival: float, done: bool,
                       conf: list[float] | None = None, reason: str = "force_final", eou_probability: float | None = None,
                       eou_frame: int = -1, next_start_frame: int | None = None) -> None:  # fmt: skip
        processed_s = int(self.scheduler.next_frame[s.slot]) * self.hop_s  # the scheduler's: stepped already
        self._updates.append(s.update(ids, frames, True, arrival, processed_s, done=done, confidences=conf,
                                      end_reason=reason, eou_probability=eou_probability, eou_frame=eou_frame))  # fmt: skip
        self._update_slots.append(s.slot)
        s.close_segment(next_start_frame)

    def _launch_diarizer(self) -> int:
        """One diarizer step over the diarized streams with a chunk ready, launched behind the ASR
        steps; collected by `_diarize`, at once with overlap off, in the next iteration with it on
        (the diarizer's host syncs are all at its collect: diarization/runner.py). Returns its rows."""
        started = time.perf_counter()
        plan = self.diarizer.plan()
        if plan is not None:
            self.diarizer.launch(plan)
        self.diarizer.seconds += time.perf_counter() - started
        return len(plan.stream_ids) if plan is not None else 0

    def _diarize(self, keep_in_flight: int) -> None:
        """Collect the diarizer steps launched before (all but the newest `keep_in_flight`), then
        hold this iteration's diarized updates until their speakers are known, and publish what is
        known (engine/speakers.py)."""
        started = time.perf_counter()
        self.diarizer.collect_all_but(keep_in_flight)
        self.diarizer.seconds += time.perf_counter() - started
        updates, slots, speakers = [], [], self.speakers
        for u, slot in zip(self._updates, self._update_slots):
            if speakers.holds(u.stream_id):
                speakers.hold(u, slot)
            else:
                updates.append(u)
                slots.append(slot)
        speakers.publish(updates, slots, self._released)
        self._updates[:], self._update_slots[:] = updates, slots
