"""Incremental features are bit-exact with NeMo's preprocessor on the whole file."""

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
    other.push(np.full(40000, 0.01, np.float32))
    other.absorb()
    a, t, frames = AudioBuffer(), 0, []
    for s in range(0, len(x), packet):
        a.push(x[s : s + packet])
        a.absorb()
        avail = fe.frames_available(a)
        if avail > t:
            if neighbour:
                frames.append(fe.compute([other, a], [3, t], avail - t)[1])
            else:
                frames.append(fe.compute([a], [t], avail - t)[0])
            t = avail
        a.discard_before(fe.first_sample_needed(t))
    a.finish()
    a.absorb()
    avail = fe.frames_available(a)
    if avail > t:
        frames.append(fe.compute([a], [t], avail - t)[0])
    return torch.cat(frames, -1)


@pytest.mark.parametrize("length", [5, 161, 400, 12345, 48077])
@pytest.mark.parametrize("packet", [1, 37, 160, 4000, 160000])
def test_bit_exact_with_whole_file(pre, length, packet):
    if packet == 1 and length > 12345:
        pytest.skip("1-sample packets over 3 s: covered by the 12345-sample case")
    x = (np.random.default_rng(length).standard_normal(length) * 0.1).astype(np.float32)
    ref, _ = pre(input_signal=torch.from_numpy(x)[None], length=torch.tensor([length]))
    got = incremental(pre, x, packet, neighbour=packet % 2 == 1)
    assert got.shape == ref[0].shape  # floor(L/160) + 1 frames, as NeMo's streaming buffer holds
    assert (got - ref[0]).abs().max().item() == 0.0


def test_frames_wait_for_two_hop_margin(pre):
    fe = FeatureExtractor(pre, hop=160, n_fft=512, device=torch.device("cpu"))
    a = AudioBuffer()
    a.push(np.zeros(319, np.float32))
    a.absorb()
    assert fe.frames_available(a) == 0
    a.push(np.zeros(1, np.float32))
    a.absorb()
    assert fe.frames_available(a) == 1  # frame 0 reads samples up to 319
    a.finish()
    a.absorb()
    assert fe.frames_available(a) == 320 // 160 + 1


def test_push_after_finish_is_refused():
    a = AudioBuffer()
    a.finish()
    with pytest.raises(RuntimeError):
        a.push(np.zeros(10, np.float32))
