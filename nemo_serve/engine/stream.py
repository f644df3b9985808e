"""One stream: its audio buffer, chunk position, tokens, text and segment state.

The network side only calls `push`, `finish`, `force_final` and `abort` (through the engine);
every other field is owned by the step loop thread.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .endpoint import EndpointConfig, EndpointDetector
from .frontend import AudioBuffer


@dataclass
class StreamResult:
    """What a stream's consumer receives after a step (or at an endpoint / end of input)."""

    stream_id: str
    text: str  # text of the current segment (partial) or of the closed segment (final)
    segment: int
    is_final: bool
    new_token_ids: list[int]  # tokens decoded by the step that produced this result
    token_ids: list[int]  # all tokens of the segment so far
    token_times_s: list[float]  # start time of each token of the segment (encoder frame * frame_s)
    segment_start_s: float
    audio_processed_s: float  # audio consumed by the model so far
    audio_arrival_time: float  # server time.time() when the last sample that produced this arrived
    done: bool = False  # no result follows this one
    error: str | None = None


class Phase(enum.Enum):
    PENDING = "pending"  # waiting for the loop to give it a slot
    ACTIVE = "active"
    DONE = "done"


class Detokenizer:
    """Token id -> text piece, so text grows by appending (never re-decoding the hypothesis)."""

    def __init__(self, vocabulary: list[str], is_bpe: bool) -> None:
        if is_bpe:
            self.pieces = [p.replace("▁", " ") if not (p.startswith("<") and p.endswith(">")) else "" for p in vocabulary]
        else:
            self.pieces = list(vocabulary)

    def text(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[t] for t in token_ids if t < len(self.pieces))


@dataclass
class Stream:
    stream_id: str
    on_result: Callable[[StreamResult], None]
    language_index: int
    endpoint_config: EndpointConfig
    frame_s: float
    audio: AudioBuffer = field(default_factory=AudioBuffer)
    # --- loop-thread state ---
    phase: Phase = Phase.PENDING
    slot: int | None = None
    next_frame: int = 0  # first feature frame of the next chunk
    token_ids: list[int] = field(default_factory=list)  # every token of the stream (all segments)
    segment: int = 0
    segment_token_ids: list[int] = field(default_factory=list)
    segment_token_times_s: list[float] = field(default_factory=list)
    segment_text: str = ""
    decoded_frames: int = 0
    final_sent: bool = False  # the done=True result has been delivered
    endpoint: EndpointDetector | None = None
    # --- requests from the network side, read by the loop ---
    _flags_lock: threading.Lock = field(default_factory=threading.Lock)
    _force_final: bool = False
    _abort_reason: str | None = None

    def __post_init__(self) -> None:
        self.endpoint = EndpointDetector(self.endpoint_config, self.frame_s)

    # network side
    def push(self, samples: np.ndarray) -> None:
        self.audio.push(samples)

    def request_force_final(self) -> None:
        with self._flags_lock:
            self._force_final = True

    def request_abort(self, reason: str) -> None:
        with self._flags_lock:
            if self._abort_reason is None:
                self._abort_reason = reason

    # loop side
    def take_force_final(self) -> bool:
        with self._flags_lock:
            f, self._force_final = self._force_final, False
        return f

    @property
    def abort_reason(self) -> str | None:
        with self._flags_lock:
            return self._abort_reason

    def add_tokens(self, ids: list[int], frames: list[int], detok: Detokenizer) -> None:
        self.token_ids.extend(ids)
        self.segment_token_ids.extend(ids)
        self.segment_token_times_s.extend(round(f * self.frame_s, 3) for f in frames)  # rounded once, not per result
        self.segment_text += detok.text(ids)
        self.endpoint.on_tokens(frames)

    def result(self, new_ids: list[int], is_final: bool, arrival: float, hop_s: float, done: bool = False) -> StreamResult:
        return StreamResult(
            stream_id=self.stream_id,
            text=self.segment_text.strip(),
            segment=self.segment,
            is_final=is_final,
            new_token_ids=list(new_ids),
            token_ids=list(self.segment_token_ids),
            token_times_s=list(self.segment_token_times_s),
            segment_start_s=round(self.endpoint.segment_start_frame * self.frame_s, 3),
            audio_processed_s=round(self.next_frame * hop_s, 3),
            audio_arrival_time=arrival,
            done=done,
        )

    def close_segment(self) -> None:
        self.segment += 1
        self.segment_token_ids = []
        self.segment_token_times_s = []
        self.segment_text = ""
        self.endpoint.new_segment(self.decoded_frames)
