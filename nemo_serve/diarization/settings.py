"""Streaming Sortformer latency settings, and putting one on a NeMo model.

The four rows are the table of NVIDIA's diar_streaming_sortformer_4spk-v2 model card ("streaming
inference configurations"; frames are 80 ms encoder frames): latency is chunk + right context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StreamingSettings:
    chunk_len: int  # encoder frames a step reports on
    chunk_right_context: int  # frames of look-ahead after the chunk
    fifo_len: int  # frames kept verbatim after the chunk, before they enter the speaker cache
    spkcache_update_period: int  # frames moved from the FIFO into the speaker cache at once
    spkcache_len: int  # frames the speaker cache keeps (compressed per speaker when over)
    chunk_left_context: int = 1  # frames of context before the chunk (model card: 1 everywhere)

    @property
    def latency_ms(self) -> int:
        return (self.chunk_len + self.chunk_right_context) * 80


MODEL_CARD_SETTINGS = {
    "very_high": StreamingSettings(340, 40, 40, 300, 188),  # 30.4 s
    "high": StreamingSettings(124, 1, 124, 124, 188),  # 10.0 s
    "low": StreamingSettings(6, 7, 188, 144, 188),  # 1.04 s
    "ultra_low": StreamingSettings(3, 1, 188, 144, 188),  # 0.32 s
}


def apply_settings(model, settings: StreamingSettings) -> None:
    """Set the streaming parameters on `model.sortformer_modules` (what NeMo's own scripts do) and check them."""
    modules = model.sortformer_modules
    for key, value in asdict(settings).items():
        setattr(modules, key, value)
    modules._check_streaming_parameters()
