"""One stream: its audio buffer, chunk position and segment state.

The network side only calls `push`, `finish`, `force_final` and `abort` (through the engine);
every other field is owned by the step loop thread. Tokens and text are not kept here: each
step emits a `StreamUpdate` with only what changed (results.py), and the consumer assembles.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

import numpy as np

from .endpoint import EndpointConfig, EndpointDetector
from .frontend import AudioBuffer
from .results import Detokenizer, ResultAssembler, StreamResult, StreamUpdate  # noqa: F401 - re-exported


class Phase(enum.Enum):
    PENDING = "pending"  # admitted (its slot held), not yet taken in by the loop (no cache row open)
    ACTIVE = "active"
    DONE = "done"


@dataclass
class Stream:
    stream_id: str
    language_index: int
    endpoint_config: EndpointConfig
    frame_s: float
    context_right: int | None = None  # the stream's chunk mode (None: the served default)
    phrases: "PhraseRequest | None" = None  # phrase boosting (engine/biasing.py); None or empty: none
    audio: AudioBuffer = field(default_factory=AudioBuffer)
    # --- loop-thread state ---
    phase: Phase = Phase.PENDING
    slot: int | None = None  # set at admission (engine/slot_table.py)
    biasing_id: int = -1  # its tree's id in the decoder's multi-model (-1: none)
    segment: int = 0
    decoded_frames: int = 0
    due: float = float("-inf")  # when its last stepped chunk was due (engine/queue_delay.py)
    final_sent: bool = False  # the done=True result has been delivered
    endpoint: EndpointDetector | None = None
    # --- requests from the network side, read by the loop ---
    _flags_lock: threading.Lock = field(default_factory=threading.Lock)
    _force_final: bool = False
    _abort_reason: str | None = None

    def __post_init__(self) -> None:
        self.endpoint = EndpointDetector(self.endpoint_config, self.frame_s)

    # network side
    def push(self, samples: np.ndarray, arrived: float | None = None) -> None:
        self.audio.push(samples, arrived)

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

    def add_tokens(self, frames: list[int]) -> None:
        self.endpoint.on_tokens(frames)

    def update(self, new_ids: list[int], new_frames: list[int], is_final: bool, arrival: float, processed_s: float,
               done: bool = False, confidences: list[float] | None = None) -> StreamUpdate:  # fmt: skip
        """`processed_s`: audio the model has consumed (the scheduler's chunk position)."""
        return StreamUpdate(
            stream_id=self.stream_id,
            segment=self.segment,
            is_final=is_final,
            done=done,
            new_token_ids=new_ids,
            new_token_frames=new_frames,
            segment_start_frame=self.endpoint.segment_start_frame,
            audio_processed_s=round(processed_s, 3),
            audio_arrival_time=arrival,
            new_token_confidences=confidences,
        )

    def close_segment(self) -> None:
        self.segment += 1
        self.endpoint.new_segment(self.decoded_frames)
