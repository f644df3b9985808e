"""One stream: its audio buffer, chunk position and segment state.

Owned by the engine's loop thread, like the rest of the engine: whether it is open is the slot
table's (engine/slot_table.py), not a field here. Tokens and text are not kept here: each step
emits a `StreamUpdate` with only what changed (results.py), and the consumer assembles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .endpoint import EndpointConfig, EndpointDetector
from .frontend import AudioBuffer
from .phrases import PhraseRequest
from .results import StreamUpdate


@dataclass
class Stream:
    stream_id: str
    language_index: int
    endpoint_config: EndpointConfig
    frame_s: float
    context_right: int | None = None  # the stream's chunk mode (None: the served default)
    phrases: PhraseRequest | None = None  # phrase boosting (engine/biasing.py); None or empty: none
    audio: AudioBuffer = field(default_factory=AudioBuffer)
    slot: int | None = None  # set at admission (engine/slot_table.py)
    biasing_id: int = -1  # its tree's id in the decoder's multi-model (-1: none)
    diarized: bool = False  # its audio also goes to the diarizer (engine/speakers.py)
    segment: int = 0
    decoded_frames: int = 0
    endpoint: EndpointDetector | None = None

    def __post_init__(self) -> None:
        self.endpoint = EndpointDetector(self.endpoint_config, self.frame_s)

    def add_tokens(self, frames: list[int]) -> None:
        self.endpoint.on_tokens(frames)

    def update(self, new_ids: list[int], new_frames: list[int], is_final: bool, arrival: float, processed_s: float,
               done: bool = False, confidences: list[float] | None = None, end_reason: str | None = None,
               eou_probability: float | None = None, eou_frame: int = -1) -> StreamUpdate:  # fmt: skip
        """`processed_s`: audio the model has consumed (the scheduler's chunk position); the rest:
        a final's ending (results.py END_REASONS)."""
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
            end_reason=end_reason,
            eou_probability=eou_probability,
            eou_frame=eou_frame,
        )

    def close_segment(self, next_start_frame: int | None = None) -> None:
        """`next_start_frame`: where the next segment starts (default: after what is decoded;
        an EOU token inside a step: the frame after it)."""
        self.segment += 1
        self.endpoint.new_segment(self.decoded_frames if next_start_frame is None else next_start_frame)
