"""Fused epilogues of the FastConformer layer: what follows each GEMM, as one function each.

NeMo's layer (ConformerLayer.forward, eval) runs, after each of its four sub-blocks, an add into
the residual stream (the FFN halves scaled by `fc_factor` 0.5) and the next sub-block's LayerNorm:
two kernels and two trips of [rows, D] through memory each time; its convolution module runs GLU,
the pad mask's masked_fill, its norm (LayerNorm over the channels in every streaming config here,
BatchNorm in some) and SiLU as four more. Here each of those is one function:

- `residual_norm(residual, y, alpha, norm)`: r = residual + alpha * y, and norm(r) (4 per layer);
- `glu_mask(x, pad_mask)`: GLU over the channels, padded frames zeroed (the conv module's first);
- `norm_silu(x, norm)`: the conv module's norm (LayerNorm over channels, or eval BatchNorm) then
  SiLU (the conv module's second).

Two backends behind one interface: `torch`, the twin, runs NeMo's own ops in NeMo's order (so on
the CPU the fused layer is NeMo's arithmetic bit for bit and the parity tests cover it); `triton`
runs each epilogue as one Triton kernel (engine/epilogue_kernels.py) that computes in fp32 and
rounds once, so it agrees with NeMo's layer within float rounding (tests/test_epilogues.py states
the tolerances; they run the kernels on the CPU under TRITON_INTERPRET=1).

NEMO_SERVE_KERNELS picks: `nemo` (NeMo's layer as engine/encoder.py always ran it) or `fused`
(this layer). Default: `fused` on the CPU (the torch twins: same arithmetic, and the layer code
the GPU will run is exercised by every CPU test); `nemo` on CUDA until a GPU run has checked the
Triton kernels' tokens (benchmarks/gpu/README.md).
"""

from __future__ import annotations

import importlib.util
import os

import torch
from nemo.collections.asr.parts.submodules.causal_convs import CausalConv1D

KERNEL_KINDS = ("nemo", "fused")


def kernels_kind(device: torch.device, kind: str | None = None) -> str:
    """`kind`, else NEMO_SERVE_KERNELS, else `fused` on the CPU and `nemo` on CUDA (module doc)."""
    kind = kind or os.environ.get("NEMO_SERVE_KERNELS") or ("nemo" if device.type == "cuda" else "fused")
    if kind not in KERNEL_KINDS:
        raise ValueError(f"NEMO_SERVE_KERNELS={kind!r}: one of {', '.join(KERNEL_KINDS)}")
    return kind


def conv_fusable(conv) -> str | None:
    """Why NeMo's conv module `conv` cannot take the fused epilogues (None: it can)."""
    if getattr(conv, "pointwise_activation", None) != "glu_":
        return "pointwise activation is not GLU"
    norm_type, norm = getattr(conv, "norm_type", None), getattr(conv, "batch_norm", None)  # NeMo's name for either
    if not ((norm_type == "layer_norm" and isinstance(norm, torch.nn.LayerNorm) and norm.weight is not None
             and norm.bias is not None and len(norm.normalized_shape) == 1)
            or (norm_type == "batch_norm" and isinstance(norm, torch.nn.BatchNorm1d) and norm.affine
                and norm.track_running_stats and not norm.training)):  # fmt: skip
        return f"conv norm {norm_type} ({type(norm).__name__}) not an affine LayerNorm or eval BatchNorm1d"
    if not isinstance(conv.activation, torch.nn.SiLU):
        return "conv activation is not SiLU/Swish"
    if not isinstance(conv.depthwise_conv, CausalConv1D):
        return "depthwise conv is not causal"
    return None


class TorchEpilogues:
    """The twins: NeMo's ops, in NeMo's order, one function per epilogue."""

    backend = "torch"

    def residual_norm(self, residual, y, alpha: float, norm, keep_residual: bool = True):
        r = torch.add(residual, y, alpha=alpha)  # alpha 1: the same op as residual + y
        return r, norm(r)

    def glu_mask(self, x, pad_mask):
        x = torch.nn.functional.glu(x, dim=1)
        return x if pad_mask is None else x.masked_fill(pad_mask.unsqueeze(1), 0.0)

    def norm_silu(self, x, norm):
        if isinstance(norm, torch.nn.LayerNorm):  # over the channels: NeMo transposes there and back
            return torch.nn.functional.silu(norm(x.transpose(1, 2)).transpose(1, 2))
        return torch.nn.functional.silu(norm(x))


class TritonEpilogues:
    """One Triton kernel per epilogue (engine/epilogue_kernels.py); fp32 inside, one rounding out."""

    backend = "triton"

    def __init__(self) -> None:
        if importlib.util.find_spec("triton") is None:  # epilogue_kernels builds its kernels with it on first use
            raise RuntimeError("NEMO_SERVE_KERNELS=fused on CUDA needs the triton package "
                               "(or NEMO_SERVE_KERNELS=nemo: NeMo's layer)")  # fmt: skip
        from . import epilogue_kernels

        self.k = epilogue_kernels
        self._bn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(bn) -> (scale, shift) [C] fp32

    def residual_norm(self, residual, y, alpha: float, norm, keep_residual: bool = True):
        return self.k.residual_norm(residual, y, alpha, norm.weight, norm.bias, norm.eps, keep_residual)

    def glu_mask(self, x, pad_mask):
        return self.k.glu_mask(x, pad_mask)

    def norm_silu(self, x, norm):
        if isinstance(norm, torch.nn.LayerNorm):
            return self.k.channel_norm_silu(x, norm.weight, norm.bias, norm.eps)
        bn = norm
        if id(bn) not in self._bn:  # eval statistics are constants: folded once into scale and shift
            scale = bn.weight.float() * torch.rsqrt(bn.running_var.float() + bn.eps)
            self._bn[id(bn)] = (scale, bn.bias.float() - bn.running_mean.float() * scale)
        return self.k.bn_silu(x, *self._bn[id(bn)])


def make_epilogues(device: torch.device, backend: str | None = None):
    """The Triton kernels on CUDA, the torch twins elsewhere (`backend` forces one: tests run the
    Triton kernels on the CPU under TRITON_INTERPRET=1)."""
    backend = backend or ("triton" if device.type == "cuda" else "torch")
    return TritonEpilogues() if backend == "triton" else TorchEpilogues()


def fused_layer(ep, layer, x, attend, pad_mask, conv_cache):
    """ConformerLayer.forward at inference with its epilogues fused: the same sub-blocks (NeMo's
    modules for the GEMMs, attention as `attend(normed)` gives it) in the same order. Returns
    (output, the next convolution cache)."""
    residual, h = ep.residual_norm(x, layer.feed_forward1(layer.norm_feed_forward1(x)), layer.fc_factor,
                                   layer.norm_self_att)  # fmt: skip
    residual, h = ep.residual_norm(residual, attend(h), 1.0, layer.norm_conv)
    c, conv_cache = conv_module(ep, layer.conv, h, pad_mask, conv_cache)
    residual, h = ep.residual_norm(residual, c, 1.0, layer.norm_feed_forward2)
    _, out = ep.residual_norm(residual, layer.feed_forward2(h), layer.fc_factor, layer.norm_out, keep_residual=False)
    return out, conv_cache


def conv_module(ep, conv, x, pad_mask, cache):
    """ConformerConvolution.forward (eval, with a cache) with GLU + mask and norm + SiLU fused."""
    if conv_fusable(conv) is not None:
        return conv(x, pad_mask=pad_mask, cache=cache)
    x = ep.glu_mask(conv.pointwise_conv1(x.transpose(1, 2)), pad_mask)
    x, cache = conv.depthwise_conv(x, cache=cache)
    x = conv.pointwise_conv2(ep.norm_silu(x, conv.batch_norm))
    return x.transpose(1, 2), cache
