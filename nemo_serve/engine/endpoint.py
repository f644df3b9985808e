"""Endpoint rules: when a segment is final.

sherpa-onnx's three rules are the defaults (online-recognizer endpoint config): a segment ends when
  rule 1: >= 2.4 s of trailing blank frames, decoded text or not;
  rule 2: >= 1.2 s of trailing blank frames after some decoded text;
  rule 3: the segment reaches 20 s, whatever it holds.
Silence is measured in encoder frames without an emitted token, so it is the model's idea of
silence, not an energy detector.

An endpoint only closes a segment (is_final, segment += 1). The encoder caches and the decoder
state carry on untouched, so the tokens of all segments concatenated equal the tokens with
endpointing off, and equal NeMo's own loop. Resetting state at an endpoint (sherpa-onnx's
default) would make the next segment start cold: different tokens, and a context loss exactly
where a speaker pauses mid-sentence. NeMo 3.0's pipeline keeps state across EOU for the same reason.

A model with end-of-utterance tokens (engine/eou.py) ends a segment when it emits one; these rules
stay as the fallback. `eou` False turns those endings off for a stream (the tokens are still hidden).
`enabled` False turns every automatic ending off, EOU ones included (the client commits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NEVER = 1 << 62  # `fires_at` of a detector whose rules are off or cannot fire


@dataclass(frozen=True)
class EndpointRule:
    must_contain_nonsilence: bool
    min_trailing_silence_s: float
    min_utterance_length_s: float

    def fires(self, has_text: bool, trailing_silence_s: float, utterance_length_s: float) -> bool:
        if self.must_contain_nonsilence and not has_text:
            return False
        return trailing_silence_s >= self.min_trailing_silence_s and utterance_length_s >= self.min_utterance_length_s


@dataclass(frozen=True)
class EndpointConfig:
    enabled: bool = True
    rule1_min_trailing_silence_s: float = 2.4
    rule2_min_trailing_silence_s: float = 1.2
    rule3_min_utterance_length_s: float = 20.0
    eou: bool = True  # end segments at the model's end-of-utterance tokens (engine/eou.py)

    @property
    def eou_endings(self) -> bool:
        return self.enabled and self.eou

    @property
    def rules(self) -> tuple[EndpointRule, ...]:
        return (
            EndpointRule(False, self.rule1_min_trailing_silence_s, 0.0),
            EndpointRule(True, self.rule2_min_trailing_silence_s, 0.0),
            EndpointRule(False, 0.0, self.rule3_min_utterance_length_s),
        )

    @classmethod
    def off(cls) -> "EndpointConfig":
        return cls(enabled=False)

    def validated(self) -> "EndpointConfig":
        for name in ("rule1_min_trailing_silence_s", "rule2_min_trailing_silence_s", "rule3_min_utterance_length_s"):
            v = getattr(self, name)
            if not (0.0 < v <= 3600.0):
                raise ValueError(f"endpoint {name} must be in (0, 3600] seconds, got {v}")
        return self


class EndpointDetector:
    """Per-stream segment bookkeeping in encoder frames. Loop thread only."""

    def __init__(self, config: EndpointConfig, frame_s: float) -> None:
        self.config = config
        self.rules = config.rules if config.enabled else ()  # built once, read every step
        self._thresholds = tuple((r.must_contain_nonsilence, r.min_trailing_silence_s, r.min_utterance_length_s) for r in self.rules)
        self.frame_s = frame_s
        self._frames_needed = tuple((needs, frames_needed(t, frame_s), frames_needed(n, frame_s)) for needs, t, n in self._thresholds)
        self.segment_start_frame = 0
        self.last_token_frame = -1  # global frame of the last token in this segment, -1 if none
        # The decoded frame count from which `is_endpoint` says a rule fires, for the state as it
        # is: the engine's collect compares one int per row per step and calls `is_endpoint` only
        # there (engine/collect.py), instead of evaluating three rules for every stepped stream.
        self.fires_at = self._first_firing_frame()

    @property
    def has_text(self) -> bool:
        """Whether the segment has a token (is_endpoint's test, inlined there: every step)."""
        return self.last_token_frame >= self.segment_start_frame

    def on_tokens(self, frames: list[int]) -> None:
        if frames:
            self.last_token_frame = frames[-1]
            self.fires_at = self._first_firing_frame()

    def is_endpoint(self, decoded_frames: int) -> str | None:
        """The reason the segment ends now ("silence": rule 1 or 2, "max_length": rule 3), else None."""
        if not self.rules:
            return None
        has_text = self.last_token_frame >= self.segment_start_frame
        silent_from = self.last_token_frame + 1 if has_text else self.segment_start_frame
        trailing_s = (decoded_frames - silent_from) * self.frame_s
        length_s = (decoded_frames - self.segment_start_frame) * self.frame_s
        if decoded_frames <= self.segment_start_frame:
            return None
        for needs_text, min_trailing_s, min_length_s in self._thresholds:  # EndpointRule.fires, inlined (every step, every stream)
            if trailing_s >= min_trailing_s and length_s >= min_length_s and (has_text or not needs_text):
                return "max_length" if min_length_s > 0 else "silence"
        return None

    def new_segment(self, decoded_frames: int) -> None:
        self.segment_start_frame = decoded_frames
        self.last_token_frame = -1
        self.fires_at = self._first_firing_frame()

    def _first_firing_frame(self) -> int:
        """The least decoded frame count at which `is_endpoint` is not None (NEVER if none): per
        rule, the later of the frames where its silence and its length first reach their minimum
        (`_frames_needed`: is_endpoint's float tests turned into whole frames once)."""
        start, first = self.segment_start_frame, NEVER
        has_text = self.last_token_frame >= start
        silent_from = self.last_token_frame + 1 if has_text else start
        for needs_text, min_trailing_frames, min_length_frames in self._frames_needed:
            if has_text or not needs_text:
                first = min(first, max(start + 1, silent_from + min_trailing_frames, start + min_length_frames))
        return first


def frames_needed(min_s: float, frame_s: float) -> int:
    """The fewest whole frames x >= 0 with `x * frame_s >= min_s`, is_endpoint's float test (it
    only turns true as x grows): the estimate in whole frames moved to where the test turns."""
    x = max(0, math.ceil(min_s / frame_s))
    while x > 0 and (x - 1) * frame_s >= min_s:
        x -= 1
    while x * frame_s < min_s:
        x += 1
    return x
