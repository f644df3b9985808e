"""Whether a diarized stream can take its feature frames from the ASR side.

The engine computes each ASR stream's log-mel frames once, per chunk, with NeMo's preprocessor on
the samples each frame reads (engine/frontend.py). Where the diarizer's preprocessor is the same
function (same class, same settings, bit-equal window and mel filterbank, both in eval mode), a
frame the ASR side computed is the frame the diarizer would compute from the same samples: the
framing, the FFT and the masking are the same, and the one thing that can differ is the mel
product's summation order, which BLAS picks from how many frames are multiplied together (up to
one ulp of a log-mel value on an AMD EPYC, bit-identical on the Intel CPUs measured): the
difference the diarizer's own piecewise frames already have from NeMo's whole-file ones.
tests/test_diarization_shared_features.py checks the speakers against NeMo's loop.

Measured configs (docs/diarization.md): the demo ASR model and demo-sortformer (80 mels) share;
the demo ASR model and tiny-sortformer (128 mels) do not; NVIDIA's Nemotron 3.5 ASR and
diar_streaming_sortformer_4spk-v2 both use 128 mels, 25 ms / 10 ms Hann, n_fft 512, "NA".
"""

from __future__ import annotations

import torch

# Settings that cannot change a frame the diarizer reads: `pad_to` only appends padding frames
# after the last one (FilterbankFeatures.forward pads after masking), and the diarizer reads no
# frame past its feature count. NeMo's ASR configs set 0 for streaming, its Sortformer configs
# leave the default 16.
IGNORED = frozenset({"pad_to"})


def feature_differences(asr_preprocessor: torch.nn.Module, diar_preprocessor: torch.nn.Module) -> list[str]:
    """What makes the two preprocessors' frames differ; empty: the diarizer may use the ASR's."""
    a, b = asr_preprocessor.featurizer, diar_preprocessor.featurizer
    found = []
    if type(asr_preprocessor) is not type(diar_preprocessor) or type(a) is not type(b):
        found.append(f"classes {type(a).__name__} / {type(b).__name__}")
    if asr_preprocessor.training or diar_preprocessor.training:
        found.append("a preprocessor in training mode (dither, augmentation)")
    for name in sorted((_settings(a).keys() | _settings(b).keys()) - IGNORED):
        if _settings(a).get(name) != _settings(b).get(name):
            found.append(f"{name}: {_settings(a).get(name)!r} / {_settings(b).get(name)!r}")
    bufs_a, bufs_b = dict(a.named_buffers()), dict(b.named_buffers())
    for name in sorted(bufs_a.keys() | bufs_b.keys()):
        x, y = bufs_a.get(name), bufs_b.get(name)
        if x is None or y is None or x.dtype != y.dtype or x.device != y.device or not torch.equal(x, y):
            found.append(f"buffer {name} differs")
    return found


def _settings(featurizer: torch.nn.Module) -> dict:
    """The featurizer's plain settings (numbers, strings, flags; not tensors or functions)."""
    return {k: v for k, v in vars(featurizer).items()
            if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None), tuple))}  # fmt: skip
