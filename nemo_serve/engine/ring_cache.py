"""Encoder caches read and written where they lie: a ring per slot, no whole-window copies.

The window layout (engine/slots.py + engine/encoder.py KVCacheEncoder) gathers every row's whole
attention window, all layers at once (`index_select` of C + S positions per row into a step
buffer), runs the layers, and writes the whole shifted window back (`index_copy_` of C positions):
per row-step 2(C+S) + 2C positions copied per layer besides what attention reads, a step buffer of
rows x L layers (engine/buckets.py caps it at 4 GiB: 512-row steps for Nemotron at 1120 ms), and
one pool of L x slots x window elements (past 2^31 from ~2,000 Nemotron slots: 64-bit index math).

Here each slot's projected keys/values are a ring of R = C + S positions per layer, and a
per-slot frame counter says where the window starts: logical position p of a row's window (0 the
oldest of its C cached frames, C + j the chunk's j-th new frame) lies at ring position
(frames + p) mod R. A step, per layer:
1. writes the chunk's t new keys/values into their ring positions (B x h x t rows of 2 d_k, the only
   attention-cache write);
2. gathers positions [0, C + t) of each row, in logical order, into a one-layer buffer [B, h, C+t, 2 d_k]
   (one `index_select` whose index is made once per step and shared by the layers);
3. attends exactly as KVCacheEncoder does over that window (same values, same shapes);
and the counter advances by t. Because R >= C + t, the new frames never overwrite a live one, and the
window's values are bit-identical to the window layout's (tests/test_ring_cache.py compares the
caches after every step through `read_encoder`, and the tokens). The convolution cache is a ring
too (K - 1 positions per layer, modulus K - 1 on the same counter): read in order per layer,
only its newest min(t, K-1) columns written.

Why a gather of C + t positions and not a kernel reading the ring in place: attention here is
torch's matmul (or SDPA, engine/attention.py) over a dense window; a paged kernel (Triton) that
indexes the ring inside the attention would drop the gather too, but it reorders the softmax's
accumulation and is for the GPU run to check. The gather is per layer, so the step buffer is one
layer's (1/L of the window layout's): no step-cache cap; steps are bounded at 2,048 rows by default
for the activations' sake (`max_ring_step_rows`), not the cache's.

32-bit index arithmetic: every layer has its own pool [S+1, h, R, 2 d_k]; `RingSlotPool` refuses a
slot count whose per-layer pool reaches 2^31 elements (Nemotron bf16 at 1120 ms: ~14,900 slots; at
80 ms alone ~18,300), so PyTorch's index kernels take their 32-bit path (`canUse32BitIndexMath`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .slots import EncoderCache, SlotPool

INDEX_LIMIT = 2**31 - 1  # elements one tensor may hold for 32-bit index arithmetic


def ring_layout_enabled(device: torch.device | None = None) -> bool:
    """NEMO_SERVE_KV_LAYOUT=ring picks the ring layout, window the reference (gather and scatter of
    whole windows); unset: ring on the CPU (proven there: tests/test_ring_cache.py, the parity
    tests), window on CUDA until a GPU run has checked the ring there (benchmarks/gpu/README.md).
    The selftest names the layout it ran."""
    v = os.environ.get("NEMO_SERVE_KV_LAYOUT") or ("window" if device is not None and device.type == "cuda" else "ring")
    if v not in ("ring", "window"):
        raise ValueError(f"NEMO_SERVE_KV_LAYOUT={v!r}: ring or window")
    return v == "ring"


def max_ring_step_rows() -> int:
    """Rows one ring-layout step may run: NEMO_SERVE_MAX_STEP_ROWS, default 2,048. Not a cache bound
    (the step buffer is one layer's) but the activations' and the CUDA graphs' memory: the pre-encode's
    first convolution alone writes ~2 MB per row at 1120 ms. The GPU run measures 2,048 against more."""
    return int(os.environ.get("NEMO_SERVE_MAX_STEP_ROWS", "2048"))


@dataclass
class RingStep:
    """One step's indices over the rows (made once, shared by every layer)."""

    rows: torch.Tensor  # [B] slot indices
    t: int  # new encoder frames this step (the same for every row)
    window_index: torch.Tensor  # [B*h*(C+t)] flat positions of the attention window, in logical order
    write_index: torch.Tensor  # [B*h*t] flat positions the new keys/values go to
    time_read: torch.Tensor  # [B*(K-1)] flat convolution-cache columns, in logical order
    time_write: torch.Tensor  # [B*m] the newest m = min(t, K-1) columns' positions after the step


class RingSlotPool(SlotPool):
    """A SlotPool whose encoder caches are per-layer rings (module docstring)."""

    layout = "ring"

    def __init__(self, model, num_slots: int, channel_shape: tuple[int, int, int], cache_len: int,
                 max_rows: int | None = None) -> None:  # fmt: skip
        """`channel_shape`: (heads, C + S, 2 d_k) as KVCacheEncoder's; `cache_len`: C."""
        self.cache_len = cache_len
        super().__init__(model, num_slots, channel_shape, max_rows or min(num_slots, max_ring_step_rows()))

    def _allocate_encoder_caches(self, n_layers: int, rows: int, shape: tuple, time_shape: tuple, dtype) -> None:
        heads, ring, width = shape
        if ring < self.cache_len + 1:
            raise ValueError(f"ring of {ring} positions for a {self.cache_len}-frame cache")
        per_layer = rows * heads * ring * width
        if per_layer > INDEX_LIMIT or rows * time_shape[0] * time_shape[1] > INDEX_LIMIT:
            raise ValueError(f"{rows - 1} slots: a layer's cache pool would pass 2^31 elements (64-bit index math)")
        self.heads, self.ring, self.kv_width = heads, ring, width
        self.time_channels, self.time_len = time_shape  # D, K-1
        z = dict(device=self.device, dtype=dtype)
        self.kv_layers = [torch.zeros(rows, heads, ring, width, **z) for _ in range(n_layers)]  # L x [S+1, h, R, 2dk]
        # Convolution cache position-major, [S+1, K-1, D]: a column is one contiguous index row.
        self.time_layers = [torch.zeros(rows, self.time_len, self.time_channels, **z) for _ in range(n_layers)]
        self.ring_frames = torch.zeros(rows, device=self.device, dtype=torch.long)  # [S+1] frames appended so far

    def _encoder_tensors(self) -> list[torch.Tensor]:
        return [*self.kv_layers, *self.time_layers, self.ring_frames]

    @property
    def cache_bytes_per_stream(self) -> int:
        return sum(x[0].numel() * x.element_size() for x in (*self.kv_layers, *self.time_layers))

    @property
    def gather_bytes_per_row(self) -> int:
        """One layer's window per row: the step buffer holds one layer, not all."""
        return self.kv_layers[0][0].numel() * self.kv_layers[0].element_size()

    def _reset_encoder_rows(self, rows: torch.Tensor) -> None:
        for t in (*self.kv_layers, *self.time_layers):
            t.index_fill_(0, rows, 0.0)
        self.ring_frames.index_fill_(0, rows, 0)

    def gather_encoder(self, rows):
        raise NotImplementedError("the ring layout is read in place by RingKVEncoder.step_in_place")

    scatter_encoder = gather_encoder

    # -- one step ---------------------------------------------------------------------------------
    def plan(self, rows: torch.Tensor, t: int) -> RingStep:
        """The step's flat indices (device tensors; no host sync)."""
        if len(rows) > self.max_step_rows:
            raise ValueError(f"{len(rows)} rows in one step; this pool's steps take at most {self.max_step_rows}")
        self.flush()
        c, h, r, k = self.cache_len, self.heads, self.ring, self.time_len
        dev = rows.device
        frames = self.ring_frames.index_select(0, rows)  # [B]
        heads = (rows * h)[:, None] + torch.arange(h, device=dev)  # [B, h] (slot, head) planes
        window = (frames[:, None] + torch.arange(c + t, device=dev)) % r  # [B, C+t] ring positions
        new = (frames[:, None] + torch.arange(c, c + t, device=dev)) % r  # [B, t]
        m = min(t, k)
        cols = (frames[:, None] + torch.arange(k, device=dev)) % k  # [B, K-1]
        # After the step the window starts t later; its newest m columns are the ones written.
        cols_after = (frames[:, None] + t + torch.arange(k - m, k, device=dev)) % k  # [B, m]
        return RingStep(
            rows=rows,
            t=t,
            window_index=(heads[:, :, None] * r + window[:, None, :]).reshape(-1),
            write_index=(heads[:, :, None] * r + new[:, None, :]).reshape(-1),
            time_read=(rows[:, None] * k + cols).reshape(-1),
            time_write=(rows[:, None] * k + cols_after).reshape(-1),
        )

    def window(self, layer: int, step: RingStep, new_kv: torch.Tensor) -> torch.Tensor:
        """Write the layer's new keys/values ([B, h, t, 2 d_k]) into the rings, then return the rows'
        windows [B, h, C + t, 2 d_k] in logical order (a view of the step buffer, valid until the
        next layer's call)."""
        pool = self.kv_layers[layer].view(-1, self.kv_width)
        pool.index_copy_(0, step.write_index, new_kv.reshape(-1, self.kv_width))
        b, n = len(step.rows), self.cache_len + step.t
        out = self._channel_buf[: b * self.heads * n * self.kv_width].view(-1, self.kv_width)
        torch.index_select(pool, 0, step.window_index, out=out)
        return out.view(b, self.heads, n, self.kv_width)

    def read_time(self, layer: int, step: RingStep) -> torch.Tensor:
        """The rows' convolution caches [B, D, K-1] in logical order (NeMo's layout; a transposed view)."""
        pool = self.time_layers[layer].view(-1, self.time_channels)
        return pool.index_select(0, step.time_read).view(len(step.rows), self.time_len, -1).transpose(1, 2)

    def write_time(self, layer: int, step: RingStep, next_cache: torch.Tensor) -> None:
        """Only the newest min(t, K-1) columns of the layer's next convolution cache ([B, D, K-1])."""
        m = min(step.t, self.time_len)
        tail = next_cache[:, :, self.time_len - m :].transpose(1, 2).reshape(-1, self.time_channels)
        self.time_layers[layer].view(-1, self.time_channels).index_copy_(0, step.time_write, tail)

    def advance(self, step: RingStep, fill: torch.Tensor) -> None:
        """After the last layer: the windows start t frames later; `fill` is the new cache_last_channel_len."""
        self.ring_frames.index_copy_(0, step.rows, self.ring_frames.index_select(0, step.rows) + step.t)
        self.cache_last_channel_len.index_copy_(0, step.rows, fill)

    def read_encoder(self, rows: torch.Tensor, cache_len: int | None = None) -> EncoderCache:
        """The rows' caches as the window layout holds them ([L, B, h, C, 2 d_k] oldest first,
        [L, B, D, K-1], fill): what the tests compare after every step."""
        step = self.plan(rows, 0)
        c = self.cache_len if cache_len is None else cache_len
        b = len(rows)
        kv = [
            layer.view(-1, self.kv_width).index_select(0, step.window_index).view(b, self.heads, -1, self.kv_width)[:, :, :c]
            for layer in self.kv_layers
        ]
        time = [self.read_time(i, step) for i in range(len(self.time_layers))]
        return EncoderCache(torch.stack(kv), torch.stack(time), self.cache_last_channel_len.index_select(0, rows))


def make_slot_pool(model, encoder, num_slots: int, max_rows: int | None = None) -> SlotPool:
    """The pool `encoder` reads: per-layer rings for RingKVEncoder, else the window layout."""
    if getattr(encoder, "in_place", False):
        return RingSlotPool(model, num_slots, encoder.channel_shape, encoder.cache_len, max_rows)
    return SlotPool(model, num_slots, encoder.channel_shape, max_rows)
