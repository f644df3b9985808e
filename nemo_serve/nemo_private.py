"""The NeMo internals nemo-serve relies on, in one place, checked against the installed NeMo at
import: NeMo 3.0 has no public way to the pieces below, and an upgrade that renames one must fail
here with one message (versions.py), not as an AttributeError in the middle of a step.

Each is an attribute or method that NeMo 3.0.0 sets or defines privately:
  - the RNN-T label-looping computer's blank index and its decoder state after <SOS>
    (`_blank_index`, `_get_batched_decoding_state_after_sos`: model.py, engine/slots.py)
  - that computer's confidence set-up and per-label confidence (`_init_confidence_method`,
    `_get_step_confidence`: engine/step.py and engine/label_loop.py, --word-confidence)
  - that computer's lazily built decoding state and CUDA graphs, and the time its buffers are
    sized for (`state`, `full_graph`, `separate_graphs`, `INITIAL_MAX_TIME`: engine/step.py's
    per-bucket copies; public names, but set only by NeMo's own code, nowhere documented)
  - the conformer encoder's input width and attention masks (`_feat_in`, `_create_masks`:
    model.py, engine/encoder.py)
  - the subsampling module's channels and stride, and a causal convolution's padding
    (`_conv_channels`, `_stride`, `_left_padding`, `_right_padding`: engine/encoder.py)
  - the preprocessor's sample rate (`_sample_rate`: training/feature_augment.py)
Imports neither torch nor NeMo: the functions take NeMo's objects.
"""

from __future__ import annotations

import copy

from .versions import require

NEMO_VERSIONS = ("3.0", "3.1")  # >=, <: tested with 3.0.0 (pyproject.toml pins it)
require("nemo_toolkit", *NEMO_VERSIONS, uses="encoder, subsampling and RNN-T decoding internals")


def blank_index(decoding_computer) -> int:
    return int(decoding_computer._blank_index)


def decoder_state_after_sos(decoding_computer, device, batch_size: int):
    """NeMo's BatchedLabelLoopingState for `batch_size` rows that have seen only <SOS>."""
    return decoding_computer._get_batched_decoding_state_after_sos(device=device, batch_size=batch_size)


def set_confidence_method(decoding_computer, method: dict) -> None:
    decoding_computer._init_confidence_method(method)


def computer_copy(decoding_computer, max_time: int | None = None):
    """A shallow copy of NeMo's label-looping computer that builds its own decoding state and
    CUDA graphs on first call (NeMo builds them lazily when these are None), instead of sharing
    the original's; `max_time`: the encoder frames its buffers are sized for (NeMo's default
    INITIAL_MAX_TIME, 375, is far more than a chunk)."""
    c = copy.copy(decoding_computer)
    c.state, c.full_graph, c.separate_graphs = None, None, None
    if max_time is not None:
        c.INITIAL_MAX_TIME = max_time
    return c


def step_confidence(decoding_computer, logits):
    """NeMo's confidence of each row's greedy label from its joint logits [N, V+1] (the computer's
    confidence method; the computer must preserve step confidence)."""
    return decoding_computer._get_step_confidence(logits)


def encoder_input_width(encoder) -> int:
    """Feature channels the conformer encoder takes (its mel count)."""
    return int(encoder._feat_in)


def attention_masks(encoder, *, att_context_size, padding_length, max_audio_length, offset, device):
    """(pad_mask, att_mask) as ConformerEncoder.forward_internal makes them."""
    return encoder._create_masks(att_context_size=att_context_size, padding_length=padding_length,
                                 max_audio_length=max_audio_length, offset=offset, device=device)  # fmt: skip


def subsampling_channels_and_stride(pre_encode) -> tuple[int, int]:
    return int(pre_encode._conv_channels), int(pre_encode._stride)


def causal_padding(conv) -> tuple[int, int] | None:
    """(left, right) padding of one of NeMo's causal convolutions; None for another layer."""
    if not hasattr(conv, "_left_padding"):
        return None
    return conv._left_padding, conv._right_padding


def preprocessor_sample_rate(preprocessor) -> int:
    return int(preprocessor._sample_rate)
