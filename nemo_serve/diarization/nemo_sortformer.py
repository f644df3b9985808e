"""The private pieces of NeMo this package calls, behind a version check.

`SortformerModules._compress_spkcache` (NeMo 3.0) is already batched over rows; calling it, rather
than a copy, keeps the speaker cache's top-k choice NeMo's by construction. `ConvSubsampling`'s
length rule (`calc_length` with the module's paddings, kernel, stride), run on host integers, gives
the pre-encoder's output lengths before the step runs, so the step's padded widths are known
without waiting for the device (diarization/update.py plan_update).
"""

from __future__ import annotations

import torch
from nemo.collections.asr.parts.submodules.subsampling import MaskedConvSequential, calc_length

from ..versions import require

require("nemo_toolkit", "3.0", "3.1",
        uses="SortformerModules._compress_spkcache, ConvSubsampling's length rule and layers "
        "(MaskedConvSequential, streaming diarization)")  # fmt: skip


def compress_spkcache(modules, embs, preds, mean_sil_emb):
    """(speaker cache [B, spkcache_len, D], its preds [B, spkcache_len, K]) kept from embs/preds [B, N, ...]."""
    spkcache, spkcache_preds, _ = modules._compress_spkcache(
        emb_seq=embs, preds=preds, mean_sil_emb=mean_sil_emb, permute_spk=False
    )
    return spkcache, spkcache_preds


def masks_every_layer(pre_encode) -> bool:
    """Whether `pre_encode` is NeMo 3.0's 2-D striding subsampler whose MaskedConvSequential masks
    each layer's input by the rows' lengths, run unsplit (the layers diarization/pre_encode.py runs
    itself); anything else goes through NeMo's own forward."""
    return (isinstance(getattr(pre_encode, "conv", None), MaskedConvSequential) and pre_encode.conv2d_subsampling
            and pre_encode.subsampling_conv_chunking_factor == 1)  # fmt: skip


def pre_encode_lengths(pre_encode, feature_lengths: list[int]) -> list[int]:
    """The frames `pre_encode` (NeMo's ConvSubsampling) returns for rows of these feature lengths,
    by its own rule on host integers: what its forward computes on the device, without a sync."""
    lengths = calc_length(torch.tensor(feature_lengths), all_paddings=pre_encode._left_padding + pre_encode._right_padding,
                          kernel_size=pre_encode._kernel_size, stride=pre_encode._stride,
                          ceil_mode=pre_encode._ceil_mode, repeat_num=pre_encode._sampling_num)  # fmt: skip
    return lengths.tolist()
