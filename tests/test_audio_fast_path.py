"""The packet decode's fast path (server/audio.py, issue 48) against the computation it replaced, on
random inputs: the same float32 samples bit for bit, and the same refusals of NaN and Inf."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from nemo_serve.server.audio import AudioDecoder, AudioError, _ZEROS


def _old_s16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.int32)


def test_pcm16_decodes_to_the_old_samples_bit_for_bit():
    rng = np.random.default_rng(48)
    d = AudioDecoder("pcm_s16le", 16000, 16000)
    for n in [1, 2, 7, 320, 321, 1600, 9000]:
        pcm = rng.integers(-32768, 32768, n, dtype=np.int64).astype("<i2")
        pcm[: min(n, 4)] = [-32768, 32767, 0, -1][: min(n, 4)]  # the extremes and zero
        got = d.decode(pcm.tobytes())
        assert got.dtype == np.float32 and got.flags.writeable
        assert np.array_equal(_bits(got), _bits(_old_s16(pcm.tobytes()))), n


def test_pcm_f32_keeps_every_finite_value_bit_for_bit():
    rng = np.random.default_rng(49)
    d = AudioDecoder("pcm_f32le", 16000, 16000)
    tiny, big = np.finfo(np.float32).smallest_subnormal, np.finfo(np.float32).max
    for n in [1, 5, 320, 8192, 8193]:
        x = rng.standard_normal(n).astype("<f4")
        x[: min(n, 5)] = np.array([big, big, tiny, -0.0, -big], np.float32)[: min(n, 5)]  # a float32 sum overflows
        got = d.decode(x.tobytes())
        assert np.array_equal(_bits(got), _bits(x)), n


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_pcm_f32_refuses_nan_and_inf_wherever_they_are(bad):
    rng = np.random.default_rng(50)
    d = AudioDecoder("pcm_f32le", 16000, 16000)
    for n in [1, 2, 319, 320, 8191, len(_ZEROS), len(_ZEROS) + 1, 20000]:
        for where in {0, n - 1, int(rng.integers(n))}:  # first, last (a SIMD tail) and anywhere
            x = rng.standard_normal(n).astype("<f4")
            x[where] = bad
            with pytest.raises(AudioError, match="NaN or Inf"):
                d.decode(x.tobytes())
    assert d.num_input_samples == 0  # a refused frame counts nothing


def test_resampled_pcm16_equals_the_old_decode_then_soxr():
    """20 ms appends at 24 kHz, as /v1/realtime's: the same resampler output as before."""
    rng = np.random.default_rng(51)
    d = AudioDecoder("pcm_s16le", 24000, 16000)
    old = soxr.ResampleStream(24000, 16000, 1, dtype="float32", quality="HQ")
    for _ in range(50):
        pcm = rng.integers(-32768, 32768, 480).astype("<i2").tobytes()
        assert np.array_equal(_bits(d.decode(pcm)), _bits(old.resample_chunk(_old_s16(pcm))))
    assert np.array_equal(_bits(d.flush()), _bits(old.resample_chunk(np.zeros(0, np.float32), last=True)))
