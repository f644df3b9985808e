"""The cache-aware encoder step, two ways: NeMo's own, and one that caches projected keys/values.

NeMo's `cache_aware_stream_step` caches each attention layer's *input* (the post-LayerNorm
frames, `cache_last_channel [L,B,C,D]`) and projects all C + T frames through `linear_k` and
`linear_v` on every step. With C = 70 cached frames and T = 2 new ones (160 ms) that is 97% of the
key/value work done again for frames that have not changed; in the CPU profiles of FastConformer-L
(benchmarks/results/archive/profile_fastconformer-l_r{1,13}_cpu_fp32.json) those `[B*(C+T), D] x [D, D]` GEMMs and the
broadcast of the positional projection over the batch were the largest costs of the step. Then each
layer concatenates cache and chunk and the encoder stacks the new caches: two more copies of the
whole cache per step.

`KVCacheEncoder` runs the same NeMo modules layer by layer but caches what attention consumes,
the projected keys and values, in a layout the attention matmuls read in place:
`[L, B, heads, C + S, 2 * d_k]` (K | V per head on the last axis; S = new frames per chunk,
scratch positions). Per step it projects only the new frames (one fused Q|K|V GEMM), writes them
into the scratch positions, attends over positions [0, C + T) without a concatenation, and hands
back positions [T, T + C) as the next cache (a view; the slot pool copies it into its rows). The
positional projection depends only on the window length, so it is computed once per mode and
multiplied per head rather than broadcast per row.

Masks, fill levels, the relative-position shift, convolution caches and the subsampling are NeMo's
own code, so the geometry cannot drift from the oracle; the arithmetic is the same up to float
rounding, and the parity tests hold it token-identical to NeMo's loop. The price is memory: the
attention cache is 2 (C + S) / C times NeMo's (2.4x at 1120 ms, 2.06x at 160 ms).

Both classes take and return `EncoderCache`; the slot pool sizes its attention cache by
`channel_shape` (per stream, after the layer axis).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from nemo.collections.asr.parts.submodules.causal_convs import CausalConv2D
from nemo.collections.asr.parts.submodules.subsampling import MaskedConvSequential, calculate_conv_output_size

from ..nemo_private import attention_masks, causal_padding, subsampling_channels_and_stride
from .attention import attention_kind, matmul_attention, sdpa_attention
from .epilogues import fused_layer, kernels_kind, make_epilogues
from .ring_cache import ring_layout_enabled
from .slots import EncoderCache


class NemoEncoder:
    """NeMo's `cache_aware_stream_step`, unchanged: caches layer inputs. NeMo reads the chunk mode
    from module state, so each call sets it (a no-op when it is already that mode) under the
    model's mode lock, which NeMo's reference loop takes too."""

    kind = "nemo"

    def __init__(self, model) -> None:
        self.model = model
        self.encoder = encoder = model.nemo.encoder
        self.channel_shape = (encoder.streaming_cfg.last_channel_cache_size, encoder.d_model)  # [C, D]

    def cache_bytes_for(self, context_right: int, pooled_bytes: int) -> int:
        """Cache bytes per stream a pool for this mode alone would hold: NeMo's layout is the same in every mode."""
        return pooled_bytes

    def describe(self, pool) -> str:
        """Which code ran (the selftest prints it)."""
        return "NeMo's cache_aware_stream_step (layer inputs cached, whole windows gathered and scattered), attention NeMo's"

    def paths(self, pool) -> dict:
        """Which path ran, per part, as short names (the selftest's `paths:` line)."""
        return {"layout": "nemo", "attention": "nemo", "epilogues": "nemo"}

    def step(self, signal, lengths, cache: EncoderCache, drop: int, full: bool = False, context_right: int | None = None):
        with self.model.nemo_mode(context_right):
            encoded, encoded_len, c_ch, c_t, c_len = self.encoder.cache_aware_stream_step(
                processed_signal=signal,
                processed_signal_length=lengths,
                cache_last_channel=cache.cache_last_channel,
                cache_last_time=cache.cache_last_time,
                cache_last_channel_len=cache.cache_last_channel_len,
                keep_all_outputs=False,
                drop_extra_pre_encoded=drop,
            )
        return encoded, encoded_len, EncoderCache(c_ch, c_t, c_len)


def kv_cache_unsupported(encoder: torch.nn.Module) -> str | None:
    """Why `KVCacheEncoder` cannot run this encoder (None if it can)."""
    cfg = encoder.streaming_cfg
    if encoder.att_context_style != "chunked_limited":
        return f"att_context_style {encoder.att_context_style!r} (needs chunked_limited)"
    if getattr(cfg, "cache_drop_size", 0) != 0:
        return "cache_drop_size != 0"
    if cfg.last_channel_cache_size <= 0:
        return "unlimited left context"
    if isinstance(encoder.pre_encode, torch.nn.Linear):
        return "linear pre-encode"
    if encoder.reduction_position is not None:
        return "time reduction inside the encoder"
    for layer in encoder.layers:
        if layer.self_attention_model != "rel_pos":
            return f"self_attention_model {layer.self_attention_model!r} (needs rel_pos)"
        if layer.is_adapter_available():
            return "adapters"
    return None


class KVCacheEncoder:
    """Cache-aware streaming encoder step with projected key/value caches (see module doc)."""

    kind = "kv"

    def __init__(self, model, attention: str | None = None, kernels: str | None = None) -> None:
        """`attention`: engine/attention.py's `matmul` (NeMo's arithmetic) or `sdpa`; None: NEMO_SERVE_ATTENTION.
        `kernels`: engine/epilogues.py's `nemo` (NeMo's layer) or `fused` epilogues; None: NEMO_SERVE_KERNELS."""
        self.attention = attention_kind(attention)
        self.kernels = kernels_kind(model.device, kernels)
        self.epilogues = make_epilogues(model.device) if self.kernels == "fused" else None
        encoder = model.nemo.encoder
        why = kv_cache_unsupported(encoder)
        if why:
            raise ValueError(f"KV-cache encoder unsupported: {why}")
        self.model = model
        self.encoder = encoder
        self.cache_len = c = encoder.streaming_cfg.last_channel_cache_size  # the same in every mode
        # Scratch positions for the largest served mode: every mode's rows share one slot pool.
        self.scratch_frames = max(g.encoder_frames for g in model.geometries.values())
        a = encoder.layers[0].self_attn
        self.channel_shape = (a.h, c + self.scratch_frames, 2 * a.d_k)  # [heads, C + S, K|V]
        # One Q|K|V weight per layer: three GEMMs over the new frames become one.
        self._qkv = []
        for layer in encoder.layers:
            a = layer.self_attn
            w = torch.cat([a.linear_q.weight, a.linear_k.weight, a.linear_v.weight]).detach()
            b = None
            if a.linear_q.bias is not None:
                b = torch.cat([a.linear_q.bias, a.linear_k.bias, a.linear_v.bias]).detach()
            self._qkv.append((w, b))
        self._pos: dict[tuple, list[torch.Tensor]] = {}  # (window, dtype, device) -> per-layer [h, P, d_k]

    def _positions(self, pos_emb: torch.Tensor) -> list[torch.Tensor]:
        key = (pos_emb.shape[1], pos_emb.dtype, pos_emb.device)
        if key not in self._pos:
            out = []
            for layer in self.encoder.layers:
                a = layer.self_attn
                p = a.linear_pos(pos_emb).view(pos_emb.shape[1], a.h, a.d_k)  # batch 1 in NeMo's buffer
                out.append(p.transpose(0, 1).contiguous())  # [h, P, d_k]
            self._pos[key] = out
        return self._pos[key]

    def describe(self, pool) -> str:
        """Which code ran (the selftest prints it): the cache layout the pool has and the attention."""
        layout = {
            "ring": "ring layout (per-layer rings read and written in place, engine/ring_cache.py)",
            "window": "window layout (whole windows gathered and scattered, NEMO_SERVE_KV_LAYOUT=window)",
        }[pool.layout]
        attention = {"matmul": "matmul + softmax (NeMo's arithmetic)", "sdpa": "SDPA with the positional bias"}[self.attention]
        return f"keys/values cached, {layout}; attention {attention}; epilogues {self.describe_epilogues()}"

    def paths(self, pool) -> dict:
        """Which path ran, per part, as short names (the selftest's `paths:` line)."""
        epilogues = "nemo" if self.epilogues is None else f"fused/{self.epilogues.backend}"
        return {"layout": pool.layout, "attention": self.attention, "epilogues": epilogues}

    def describe_epilogues(self) -> str:
        """Which layer epilogues ran (engine/epilogues.py)."""
        if self.epilogues is None:
            return "NeMo's (add and LayerNorm, GLU, BatchNorm and SiLU as separate ops)"
        how = {"torch": "torch twins, NeMo's ops", "triton": "Triton kernels"}[self.epilogues.backend]
        return f"fused ({how}; NEMO_SERVE_KERNELS=nemo for NeMo's layer)"

    def cache_bytes_for(self, context_right: int, pooled_bytes: int) -> int:
        """Cache bytes per stream a pool for this mode alone would hold (`pooled_bytes`: the shared pool's,
        whose attention cache has scratch positions for the largest mode)."""
        a = self.encoder.layers[0].self_attn
        per_position = len(self.encoder.layers) * a.h * 2 * a.d_k * torch.finfo(self.model.dtype).bits // 8
        return pooled_bytes - per_position * (self.scratch_frames - self.model.geometry_for(context_right).encoder_frames)

    def step(self, signal, lengths, cache: EncoderCache, drop: int, full: bool = False, context_right: int | None = None):
        """`full`: every row's length is the signal's width (the caller knows it on the host).
        `context_right`: the rows' mode (None: the default). The mode is an argument, not NeMo's
        module state: the masks get its att_context_size and the output its frame count."""
        c = self.cache_len
        front = self._front(signal, lengths, cache.cache_last_channel_len, drop, full, context_right)
        kv = cache.cache_last_channel  # [L, B, h, C + S, 2 d_k], gathered: ours to write
        t, dk = front.t, kv.shape[-1] // 2

        def window(i, new):  # new [B, t, 2, h, d_k] -> positions [C, C+t) of the gathered window
            kv[i][:, :, c : c + t, :dk].copy_(new[:, :, 0].transpose(1, 2))
            kv[i][:, :, c : c + t, dk:].copy_(new[:, :, 1].transpose(1, 2))
            return kv[i][:, :, : c + t]

        time_next = []
        x = self._layers(front, window, lambda i: cache.cache_last_time[i], lambda i, nxt: time_next.append(nxt))
        encoded, encoded_len = self._outputs(x, front)
        fill = torch.clamp(cache.cache_last_channel_len + t, max=c)
        next_kv = kv[:, :, :, t : t + c]  # NeMo's update_cache: drop the oldest t, keep C
        return encoded, encoded_len, EncoderCache(next_kv, torch.stack(time_next), fill)

    def _front(self, signal, lengths, fill, drop: int, full: bool, context_right):
        """Subsampling, pre-encode drop, masks and positions: NeMo's forward_internal, L636-681."""
        enc = self.encoder
        c = self.cache_len
        g = self.model.geometry_for(context_right)
        x, length = self._pre_encode(signal.transpose(1, 2), lengths, full)
        length = length.to(torch.int64)
        if drop > 0:
            x = x[:, drop:, :]
            length = (length - drop).clamp(min=0)
        t = x.size(1)
        x, pos_emb = enc.pos_enc(x=x, cache_len=c)
        pad_mask, att_mask = attention_masks(
            enc,
            att_context_size=[g.context_left, g.context_right],
            padding_length=length + c,
            max_audio_length=t + c,
            offset=c - fill,
            device=x.device,
        )
        pad_mask, att_mask = pad_mask[:, c:], att_mask[:, c:]
        if t > g.encoder_frames:
            raise ValueError(f"chunk of {t} encoder frames; this mode adds at most {g.encoder_frames}")
        # The mask's per-head view and its all-masked rows are the same in every layer: made once.
        masks = (att_mask, att_mask.unsqueeze(1), att_mask.all(dim=-1)[:, None, :, None])
        return _Front(x, length, t, pad_mask, masks, self._positions(pos_emb), g.encoder_frames)

    def _layers(self, front: "_Front", window, time_cache, keep_time) -> torch.Tensor:
        """The conformer layers over the new frames. `window(i, new)` stores layer i's new keys/values
        and returns its attention window; `time_cache(i)` is its convolution cache, `keep_time(i, next)`
        takes the next one. Each layer runs as NeMo's (`_nemo_layer`) or with fused epilogues
        (engine/epilogues.py `fused_layer`), as NEMO_SERVE_KERNELS says."""
        x = front.x
        for i, layer in enumerate(self.encoder.layers):
            def attend(h, i=i, layer=layer):
                return self._attention(i, layer.self_attn, h, front.masks, front.positions[i], window)

            if self.epilogues is None:
                x, conv_cache = self._nemo_layer(layer, x, attend, front.pad_mask, time_cache(i))
            else:
                x, conv_cache = fused_layer(self.epilogues, layer, x, attend, front.pad_mask, time_cache(i))
            keep_time(i, conv_cache)
        return x

    @staticmethod
    def _nemo_layer(layer, x, attend, pad_mask, conv_cache):
        """ConformerLayer.forward at inference, NeMo's modules and ops."""
        # x + ff(x) * fc_factor as one add (alpha): the product by 0.5 is exact, so is the sum.
        residual = torch.add(x, layer.feed_forward1(layer.norm_feed_forward1(x)), alpha=layer.fc_factor)
        residual = residual + attend(layer.norm_self_att(residual))
        h, conv_cache = layer.conv(layer.norm_conv(residual), pad_mask=pad_mask, cache=conv_cache)
        residual = residual + h
        residual = torch.add(residual, layer.feed_forward2(layer.norm_feed_forward2(residual)), alpha=layer.fc_factor)
        return layer.norm_out(residual), conv_cache

    def _outputs(self, x, front: "_Front"):
        if self.encoder.out_proj is not None:
            x = self.encoder.out_proj(x)
        # streaming_post_process: the encoder emits exactly valid_out_len frames per full chunk.
        encoded = x.transpose(1, 2)[:, :, : front.new_frames]
        return encoded, front.length.clamp(max=front.new_frames)

    def _pre_encode(self, x, lengths, full: bool):
        """NeMo's subsampling. When no row is padded, its time masks are all ones: multiplying
        by them before each of the eight conv/activation layers is skipped (x * 1.0 == x); the gain
        is measured in benchmarks/results/profile_fastconformer-l_r13_kv_nomask_cpu_fp32.json."""
        pe = self.encoder.pre_encode
        if not (full and isinstance(pe.conv, MaskedConvSequential) and pe.conv2d_subsampling):
            return pe(x=x, lengths=lengths)
        channels, stride = subsampling_channels_and_stride(pe)
        if pe.subsampling_conv_chunking_factor != 1 or x.numel() > 2**31 / channels * stride**2:
            return pe(x=x, lengths=lengths)  # NeMo would split the batch: keep its path
        h = x.unsqueeze(1)  # [B, 1, T, F]
        cur = lengths.float()
        for layer in pe.conv:  # MaskedConvSequential.forward without the masks
            h = causal_conv2d(layer, h) if isinstance(layer, CausalConv2D) else layer(h)
            if hasattr(layer, "stride") and layer.stride != (1, 1):
                pad = causal_padding(layer) or layer.padding
                cur = calculate_conv_output_size(cur, layer.kernel_size[0], layer.stride[0], pad)
        b, _, t, _ = h.shape
        return pe.out(h.transpose(1, 2).reshape(b, t, -1)), cur.long()

    def _attention(self, i, a, x, masks, p, window):
        """RelPositionMultiHeadAttention.forward over cached projected keys/values.

        masks: (att_mask [B,T,C+T], its [B,1,T,C+T] view, [B,1,T,1] rows with every position
        masked); x [B,T,D] new frames (post-LayerNorm); `window(i, new)` stores the new keys/values
        (new [B,T,2,h,d_k]) and returns the layer's window [B,h,C+T,2 d_k]; p [h,P,d_k] projected positions.
        """
        b, t, d = x.shape
        mask, mask_heads, all_masked = masks
        h, dk = a.h, a.d_k
        w, bias = self._qkv[i]
        qkv = torch.nn.functional.linear(x, w, bias)  # [B, T, 3D]
        q = qkv[..., :d].view(b, t, h, dk)
        kv = window(i, qkv[..., d:].view(b, t, 2, h, dk))
        k, v = kv[..., :dk], kv[..., dk:]  # [B, h, C+T, d_k], read in place
        q_u = (q + a.pos_bias_u).transpose(1, 2)  # [B, h, T, d_k]
        q_v = (q + a.pos_bias_v).transpose(1, 2)
        # Positions are shared by every row: one [h, B*T, d_k] x [h, d_k, P] product per head,
        # instead of broadcasting [1, h, P, d_k] over the batch.
        bd = torch.bmm(q_v.transpose(0, 1).reshape(h, b * t, dk), p.transpose(1, 2))
        bd = a.rel_shift(bd.view(h, b, t, -1).transpose(0, 1))
        if self.attention == "sdpa" or a.use_pytorch_sdpa:
            return sdpa_attention(a, q_u, k, v, bd, mask_heads, all_masked)
        return matmul_attention(a, q_u, k, v, bd, mask)


@dataclass
class _Front:
    """What the layers need, made once per step by `_front`."""

    x: torch.Tensor  # [B, T, D] subsampled new frames (positional scaling applied)
    length: torch.Tensor  # [B] valid new frames
    t: int  # new frames (the tensor's width)
    pad_mask: torch.Tensor  # [B, T]
    masks: tuple  # (att_mask [B,T,C+T], [B,1,T,C+T], all-masked rows [B,1,T,1])
    positions: list  # per layer [h, P, d_k]
    new_frames: int  # frames this mode emits per chunk


class RingKVEncoder(KVCacheEncoder):
    """KVCacheEncoder over a RingSlotPool (engine/ring_cache.py): reads and writes the rows' caches
    where they lie, per layer, instead of taking a gathered window and returning a shifted one."""

    kind = "kv"  # the same arithmetic; the pool says the layout (pool.layout)
    in_place = True

    def step_in_place(self, signal, lengths, pool, rows, drop: int, full: bool = False, context_right=None):
        """The step over slot `rows` of `pool` (a RingSlotPool); returns (encoded, encoded_len)."""
        fill = pool.cache_last_channel_len.index_select(0, rows)
        front = self._front(signal, lengths, fill, drop, full, context_right)
        ring = pool.plan(rows, front.t)

        def window(i, new):  # [B, t, 2, h, d_k] -> [B, h, t, 2 d_k], the ring's write layout
            return pool.window(i, ring, new.permute(0, 3, 1, 2, 4))

        x = self._layers(front, window, lambda i: pool.read_time(i, ring), lambda i, nxt: pool.write_time(i, ring, nxt))
        pool.advance(ring, torch.clamp(fill + front.t, max=self.cache_len))
        return self._outputs(x, front)


def causal_conv2d(conv: CausalConv2D, x: torch.Tensor) -> torch.Tensor:
    """`CausalConv2D.forward` without materialising its padded input where that is cheaper.

    NeMo pads (left = k - 1, right = s - 1) with `F.pad`, a zero-filled copy of the activation,
    then convolves unpadded. Padding both sides by `left` inside the convolution reads the same
    windows (same left edge) plus at most one extra trailing output per axis, sliced off: the
    result is bit-identical (tests/test_encoder.py). The slice makes the next layer copy the
    output, so NeMo's explicit pad is kept where the input is the smaller tensor (the 1-channel
    first layer); the 256-channel depthwise layers take the in-convolution padding.
    """
    left, right = causal_padding(conv)
    if conv.padding_mode != "zeros" or right > left:
        return conv(x)

    def out(n: int, pad: int, k: int, s: int, d: int) -> int:
        return (n + pad - d * (k - 1) - 1) // s + 1

    (h, w), (kh, kw), (sh, sw), (dh, dw) = x.shape[-2:], conv.kernel_size, conv.stride, conv.dilation
    out_h, out_w = out(h, left + right, kh, sh, dh), out(w, left + right, kw, sw, dw)
    sliced = (out(h, 2 * left, kh, sh, dh), out(w, 2 * left, kw, sw, dw)) != (out_h, out_w)
    if sliced and x.numel() < x.shape[0] * conv.out_channels * out_h * out_w:
        return conv(x)
    y = torch.nn.functional.conv2d(x, conv.weight, conv.bias, conv.stride, left, conv.dilation, conv.groups)
    return y[..., :out_h, :out_w]


def make_encoder(model, kv_cache: bool = True, ring: bool | None = None):
    """The KV-cache step where the architecture allows it, else NeMo's own (`model`: a ServedModel).
    `ring`: its caches as per-layer rings read in place (engine/ring_cache.py); None: as
    NEMO_SERVE_KV_LAYOUT says (engine/ring_cache.py `ring_layout_enabled`)."""
    if kv_cache and kv_cache_unsupported(model.nemo.encoder) is None:
        if ring is None:
            ring = ring_layout_enabled(model.device)
        return RingKVEncoder(model) if ring else KVCacheEncoder(model)
    return NemoEncoder(model)
