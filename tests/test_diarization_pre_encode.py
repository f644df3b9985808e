"""The diarizer's pre-encoder with masks on padded rows only (diarization/pre_encode.py) against NeMo's
own ConvSubsampling forward: the same embeddings bit for bit and the same lengths, on batches of
steady rows only (no mask applied at all) and of rows padded by every amount down to a row shorter
than a convolution's kernel; the caller's features are not written to."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from nemo_serve.builtin.sortformer import build_diarizer
from nemo_serve.diarization.pre_encode import pre_encode


@functools.lru_cache(maxsize=None)
def built():
    return build_diarizer("tiny-sortformer", 0)


def _batch(lengths: list[int], num_features: int) -> torch.Tensor:
    """[B, max(lengths), F] random features, and past each row's length not zeros (make_batch's) but
    7.0, so that the first layer's mask matters too."""
    gen = torch.Generator().manual_seed(sum(lengths))
    features = torch.full((len(lengths), max(lengths), num_features), 7.0)
    for row, n in enumerate(lengths):
        features[row, :n] = torch.randn(n, num_features, generator=gen)
    return features


@pytest.mark.parametrize(
    "lengths",
    [
        [112] * 6,  # steady chunks only: no row is masked
        [112, 104, 112, 57, 9, 2, 1, 111],  # first chunks, last chunks of every size, one under a kernel
        [32, 24, 16],  # the 0.32 s setting's chunk, first chunk and a short last one
    ],
)
def test_pre_encode_equals_nemo_bit_for_bit(lengths):
    module = built().encoder.pre_encode
    features = _batch(lengths, module._feat_in)
    before = features.clone()
    with torch.no_grad():
        theirs, their_lengths = module(x=features, lengths=torch.tensor(lengths))
        ours, our_lengths = pre_encode(module, features, np.array(lengths))
    assert torch.equal(features, before)  # the caller's staging is not written to
    assert our_lengths.tolist() == their_lengths.long().tolist()
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)
