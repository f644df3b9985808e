"""Incremental features equal NeMo's preprocessor on the whole file, within the float32 rounding of
the mel filterbank product (derived in `mel_tolerance`), on any x86 CPU."""

import numpy as np
import pytest
import torch
from nemo.collections.asr.modules import AudioToMelSpectrogramPreprocessor

from nemo_serve.engine.frontend import AudioBuffer, FeatureExtractor


@pytest.fixture(scope="module", params=[80, 128])
def pre(request):
    return AudioToMelSpectrogramPreprocessor(features=request.param, dither=0.0, pad_to=0, normalize="NA").eval()


def incremental(pre, x: np.ndarray, packet: int, neighbour: bool) -> torch.Tensor:
    fe = FeatureExtractor(pre, hop=160, n_fft=512, device=torch.device("cpu"))
    other = AudioBuffer()  # a batch neighbour: batching must not change a stream's features
    other.extend((np.full(40000, 0.01, np.float32),), 0.0)
    a, t, frames = AudioBuffer(), 0, []
    for s in range(0, len(x), packet):
        a.extend((x[s : s + packet],), 0.0)
        avail = fe.frames_available(a)
        if avail > t:
            if neighbour:
                frames.append(fe.compute([other, a], [3, t], avail - t)[1])
            else:
                frames.append(fe.compute([a], [t], avail - t)[0])
            t = avail
        a.discard_before(fe.first_sample_needed(t))
    a.finish()
    avail = fe.frames_available(a)
    if avail > t:
        frames.append(fe.compute([a], [t], avail - t)[0])
    return torch.cat(frames, -1)


def mel_tolerance(ref: torch.Tensor, n_freq: int = 257) -> torch.Tensor:
    """Largest |incremental - whole-file| log-mel difference that float32 rounding allows, per element.

    Everything before the mel product is frame-local (each frame's own FFT) and bit-identical on
    both sides. The product m = sum_k fb[k] p[k] over n = n_fft/2 + 1 bins is a BLAS GEMM whose
    summation order depends on how many frames are multiplied together (blocking differs between
    CPUs: bit-identical on the Intel CPUs measured, up to 9.5e-7 on an AMD EPYC). Any order of a
    float32 dot product is within gamma_n * sum_k |fb[k] p[k]| of the exact sum, gamma_n =
    n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1);
    every term is >= 0, so that is gamma_n * m, and two orders differ by at most 2 gamma_n * m.
    Adding the positive guard 2^-24 (one more rounding each side, 2u) cannot raise the relative
    difference, and log turns a relative difference r into an absolute one <= r / (1 - r). Each
    side's log is within 1 ulp of its input's true log (Sleef's u10 log), so: 2 ulp(|y|) more.
    For n = 257: 3.1e-5 + 2 ulp (<= 3.5e-5 for log-mel values in (-16, 16)).
    """
    u = 2.0**-24
    gamma = n_freq * u / (1 - n_freq * u)
    r = 2 * gamma + 2 * u
    ulp = torch.finfo(torch.float32).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126))))
    return r / (1 - r) + 2 * ulp


@pytest.mark.parametrize("length", [5, 161, 400, 12345, 48077])
@pytest.mark.parametrize("packet", [1, 37, 160, 4000, 160000])
def test_equal_to_whole_file_within_mel_rounding(pre, length, packet):
    if packet == 1 and length > 12345:
        pytest.skip("1-sample packets over 3 s: covered by the 12345-sample case")
    x = (np.random.default_rng(length).standard_normal(length) * 0.1).astype(np.float32)
    ref, _ = pre(input_signal=torch.from_numpy(x)[None], length=torch.tensor([length]))
    got = incremental(pre, x, packet, neighbour=packet % 2 == 1)
    assert got.shape == ref[0].shape  # floor(L/160) + 1 frames, as NeMo's streaming buffer holds
    diff = (got - ref[0]).abs()
    assert (diff <= mel_tolerance(ref[0])).all(), f"max |diff| {diff.max().item():.3g}"
    # NeMo's masked frame past the end is exact zeros on both sides, whatever the CPU.
    assert torch.equal(got[:, -1], ref[0][:, -1]) and not got[:, -1].any()


def test_tolerance_catches_a_one_sample_misalignment(pre):
    """The tolerance is not vacuous: a front end off by one sample is far outside it."""
    x = (np.random.default_rng(3).standard_normal(8000) * 0.1).astype(np.float32)
    ref, _ = pre(input_signal=torch.from_numpy(x)[None], length=torch.tensor([8000]))
    shifted, _ = pre(input_signal=torch.from_numpy(np.concatenate([[0.0], x[:-1]]).astype(np.float32))[None],
                     length=torch.tensor([8000]))
    assert float(mel_tolerance(ref[0]).max()) < 4e-5
    assert ((shifted[0] - ref[0]).abs() > mel_tolerance(ref[0])).float().mean() > 0.5


def test_frames_wait_for_two_hop_margin(pre):
    fe = FeatureExtractor(pre, hop=160, n_fft=512, device=torch.device("cpu"))
    a = AudioBuffer()
    a.extend((np.zeros(319, np.float32),), 0.0)
    assert fe.frames_available(a) == 0
    a.extend((np.zeros(1, np.float32),), 0.0)
    assert fe.frames_available(a) == 1  # frame 0 reads samples up to 319
    a.finish()
    assert fe.frames_available(a) == 320 // 160 + 1


def test_samples_in_pieces_equal_samples_in_one():
    """The engine core copies wrapped ring halves straight into the buffer; the samples, the
    arrival bookkeeping and what a chunk reads must be those of the same packets in one piece."""
    rng = np.random.default_rng(1)
    packets = [rng.standard_normal(n).astype(np.float32) for n in (1600, 0, 37, 20000, 5)]
    pushed, extended = AudioBuffer(), AudioBuffer()
    for i, p in enumerate(packets):
        pushed.extend((p,), float(i))
        cut = len(p) // 3
        extended.extend((p[:cut], p[cut:]), float(i))
    assert extended.num_samples == pushed.num_samples == sum(map(len, packets))
    a, b = np.empty(30000, np.float32), np.empty(30000, np.float32)
    pushed.copy_segment(-100, a)
    extended.copy_segment(-100, b)
    assert np.array_equal(a, b)
    for end in (1, 1600, 1637, 1638, 21637, 21642):
        assert extended.arrival_time(end) == pushed.arrival_time(end)
    for buf in (pushed, extended):
        buf.discard_before(21000)
    pushed.copy_segment(21000, a[:642])
    extended.copy_segment(21000, b[:642])
    assert np.array_equal(a[:642], b[:642])
