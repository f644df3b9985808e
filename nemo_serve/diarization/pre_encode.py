"""The diarizer's pre-encoder (NeMo's ConvSubsampling) with its length masks only on padded rows.

NeMo 3.0's `MaskedConvSequential` multiplies the input of each of its layers (and its output) by a
[B, C, T, F] mask of the rows' lengths, nine full-size multiplies for dw_striding x8, so that a
padded row's frames do not see its padding. On a row that fills the batch's width the mask is all
ones and `x * 1.0 == x`: here the multiply is applied, as NeMo applies it, to the padded rows only,
and skipped where no row is padded (most steps: every row a steady chunk). Same layers, same
values, bit for bit (tests/test_diarization_pre_encode.py). Measured (benchmarks/results/
diar_step_profile_cpu.json): the masks were most of the pre-encoder's time at B = 32.

The lengths are host integers (the step's plan knows them), so deciding which rows to mask reads
nothing from the device. A pre-encoder of another kind goes through NeMo's own forward.
"""

from __future__ import annotations

import numpy as np
import torch

from .nemo_sortformer import masks_every_layer
from .update import device_index

# False: NeMo's own forward for every batch, all rows masked (benchmarks' before; diarization_cost.py).
MASK_PADDED_ROWS_ONLY = True


def pre_encode(module, features: torch.Tensor, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """features [B, T, F] (zero past each row's length), lengths [B] host ints -> ([B, T', D], [B] long)."""
    if not MASK_PADDED_ROWS_ONLY or not masks_every_layer(module) or _would_split(module, features):
        embs, out_lengths = module(x=features, lengths=device_index(lengths, features.device))
        return embs, out_lengths.to(torch.long)
    x, lengths = features.unsqueeze(1), np.asarray(lengths, np.int64)  # [B, 1, T, F]
    owned = False  # x is the caller's tensor until a layer makes a new one
    for layer in module.conv:
        x, owned = _mask_padded_rows(x, lengths, owned)
        if getattr(layer, "inplace", False) and not owned:
            x, owned = x.clone(), True
        x, owned = layer(x), owned or not getattr(layer, "inplace", False)
        if getattr(layer, "stride", (1, 1)) != (1, 1):
            lengths = _strided_lengths(layer, lengths)
    x, _ = _mask_padded_rows(x, lengths, owned)
    b, c, t, f = x.shape
    embs = module.out(x.transpose(1, 2).reshape(b, t, -1))
    return embs, device_index(lengths, features.device)


def _mask_padded_rows(x: torch.Tensor, lengths: np.ndarray, owned: bool) -> tuple[torch.Tensor, bool]:
    """NeMo's `apply_channel_mask` ([B, C, T, F] times the 0/1 time mask) on the rows shorter than
    T, in place on their padded frames (times 0.0, as NeMo's multiply, so the same signed zeros);
    the others are left as they are (their mask is all ones). A loop over the padded rows only,
    which are few (a stream's first or last chunk): rejected, one index_put over them, which
    copied the rows twice and was slower than NeMo's one multiply on small batches."""
    width = x.shape[2]
    rows = np.flatnonzero(lengths < width)
    if not len(rows):
        return x, owned
    if not owned:
        x = x.clone()
    for row in rows.tolist():
        x[row, :, max(int(lengths[row]), 0) :, :].mul_(0.0)
    return x, True


def _strided_lengths(layer, lengths: np.ndarray) -> np.ndarray:
    """NeMo's `calculate_conv_output_size` (floor division, as NeMo's on float lengths)."""
    left, right = (layer._left_padding, layer._right_padding) if hasattr(layer, "_left_padding") else layer.padding
    return (lengths + left + right - layer.kernel_size[0]) // layer.stride[0] + 1


def _would_split(module, features: torch.Tensor) -> bool:
    """NeMo splits the batch past 2**31 elements in a conv (its own limit check); leave that to it."""
    return features.numel() > 2**31 / module._conv_channels * module._stride * module._stride
