"""Binary frames -> float32 samples at the model's rate: PCM decoding, checks, resampling.

Resampling is soxr's streaming resampler, one per connection. Its output does not depend on
how the input was cut into frames and equals one-shot `soxr.resample` of the whole signal
(checked in tests), so a stream's tokens do not depend on its packet sizes.
Rejected: resampling each frame on its own (clicks and phase jumps at every frame edge) and
torchaudio (no streaming state; would pull the resampling onto the model's thread).
"""

from __future__ import annotations

import numpy as np
import soxr

_DTYPES = {"pcm_f32le": np.dtype("<f4"), "pcm_s16le": np.dtype("<i2")}


class AudioError(ValueError):
    """The frame is not valid audio; the reason goes on the wire."""


class AudioDecoder:
    """One connection's PCM decoder. Runs on the event loop; soxr is C and fast at these sizes."""

    def __init__(self, encoding: str, input_rate: int, model_rate: int) -> None:
        self.dtype = _DTYPES[encoding]
        self.input_rate = input_rate
        self.model_rate = model_rate
        self.num_input_samples = 0
        self._resampler = None
        if input_rate != model_rate:
            self._resampler = soxr.ResampleStream(input_rate, model_rate, 1, dtype="float32", quality="HQ")

    @property
    def input_seconds(self) -> float:
        return self.num_input_samples / self.input_rate

    def decode(self, data: bytes) -> np.ndarray:
        """One frame -> float32 samples at the model's rate (possibly empty while soxr fills up)."""
        if len(data) % self.dtype.itemsize:
            raise AudioError(
                f"binary frame of {len(data)} bytes is not a whole number of {self.dtype.itemsize}-byte samples"
            )
        samples = np.frombuffer(data, dtype=self.dtype)
        if self.dtype.kind == "i":
            samples = samples.astype(np.float32) / 32768.0
        else:
            samples = samples.astype(np.float32)  # native order, and a writable copy
            if not np.isfinite(samples).all():
                raise AudioError("audio contains NaN or Inf samples")
        self.num_input_samples += len(samples)
        if self._resampler is None:
            return samples
        return self._resampler.resample_chunk(samples)

    def flush(self) -> np.ndarray:
        """The resampler's tail at end of input."""
        if self._resampler is None:
            return np.zeros(0, dtype=np.float32)
        return self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
