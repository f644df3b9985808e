"""The slot pool: every open stream's encoder caches and RNN-T decoder state, preallocated.

One row (slot) per stream in fixed tensors, allocated once at start-up. A step gathers the
rows of its streams with `index_select`, runs the model on the dense batch, and writes the
new state back with `index_copy_`; a freed row is reset in place. Only the step loop thread
touches this object.

Why slot tensors and not per-stream tensors stacked each step (sherpa-onnx's StackStates, NeMo's
Hypothesis.dec_state): the gather is one kernel per tensor whatever the batch, and a freed
stream costs a row reset instead of an allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from nemo.collections.asr.parts.submodules.transducer_decoding.label_looping_base import BatchedLabelLoopingState

from .errors import NoFreeSlotError  # noqa: F401 - raised here, importable without torch


@dataclass
class EncoderCache:
    cache_last_channel: torch.Tensor  # [L, B, C, D] layer inputs (NeMo's layout) or [L, B, ...] (engine/encoder.py)
    cache_last_time: torch.Tensor  # [L, B, D, K-1]
    cache_last_channel_len: torch.Tensor  # [B]


class SlotPool:
    """Owns the cache tensors, the free list and the stream-to-slot map."""

    def __init__(self, model, num_slots: int, channel_shape: tuple[int, ...] | None = None) -> None:
        """`channel_shape`: one stream's attention cache after the layer axis (default NeMo's [C, D])."""
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        dev, dtype = model.device, model.dtype
        (n_layers, c, d), (_, d2, k) = model.cache_shapes
        shape = channel_shape or (c, d)
        self.cache_last_channel = torch.zeros(n_layers, num_slots, *shape, device=dev, dtype=dtype)  # [L, S, *shape]
        self.cache_last_time = torch.zeros(n_layers, num_slots, d2, k, device=dev, dtype=dtype)  # [L, S, D, K-1]
        self.cache_last_channel_len = torch.zeros(num_slots, device=dev, dtype=torch.long)  # [S]
        self._channel_buf: torch.Tensor | None = None  # gather_encoder's output, grown to the largest batch
        # Decoder state after <SOS>, one row; a fresh slot is reset to it.
        sos = model.decoding_computer._get_batched_decoding_state_after_sos(device=dev, batch_size=1)
        self._sos = sos
        self.predictor_states = [s.repeat(1, num_slots, 1).contiguous() for s in sos.predictor_states]  # [layers, S, H]
        self.predictor_outputs = sos.predictor_outputs.repeat(num_slots, 1, 1).contiguous()  # [S, 1, J]
        self.labels = sos.labels.repeat(num_slots).contiguous()  # [S]
        self.decoded_lengths = torch.zeros(num_slots, device=dev, dtype=torch.long)  # [S]
        if sos.fusion_states_list:
            raise ValueError("LM fusion / biasing states are not supported by the slot pool")
        # Feature history: the last pre-encode-cache frames each later chunk is prefixed with.
        g = model.geometry
        self.feature_history = torch.zeros(num_slots, model.num_mels, g.pre_cache_frames, device=dev)  # [S, F, 9]
        self.languages = torch.zeros(num_slots, device=dev, dtype=torch.long)  # [S]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # stack: lowest slot first
        self.stream_to_slot: dict[str, int] = {}  # stream_id -> slot

    @property
    def cache_bytes_per_stream(self) -> int:
        """Encoder cache bytes one slot holds (attention + convolution caches)."""
        t = (self.cache_last_channel, self.cache_last_time)
        return sum(x[:, 0].numel() * x.element_size() for x in t)

    # -- allocation -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.stream_to_slot)

    def allocate(self, stream_id: str, language_index: int = 0) -> int:
        if stream_id in self.stream_to_slot:
            raise ValueError(f"stream {stream_id!r} already holds a slot")
        if not self._free:
            raise NoFreeSlotError(f"all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self.stream_to_slot[stream_id] = slot
        self.languages[slot] = language_index
        return slot

    def free(self, stream_id: str) -> None:
        """Release the stream's slot and reset its row; a second call is a no-op."""
        slot = self.stream_to_slot.pop(stream_id, None)
        if slot is None:
            return
        self._reset_rows(torch.tensor([slot], device=self.cache_last_channel_len.device))
        self._free.append(slot)
        assert self.num_free + self.num_used == self.num_slots

    def _reset_rows(self, rows: torch.Tensor) -> None:
        self.cache_last_channel.index_fill_(1, rows, 0.0)
        self.cache_last_time.index_fill_(1, rows, 0.0)
        self.cache_last_channel_len.index_fill_(0, rows, 0)
        n = len(rows)
        for dst, src in zip(self.predictor_states, self._sos.predictor_states):
            dst.index_copy_(1, rows, src.expand(-1, n, -1).contiguous())
        self.predictor_outputs.index_copy_(0, rows, self._sos.predictor_outputs.expand(n, -1, -1).contiguous())
        self.labels.index_copy_(0, rows, self._sos.labels.expand(n).contiguous())
        self.decoded_lengths.index_fill_(0, rows, 0)
        self.feature_history.index_fill_(0, rows, 0.0)
        self.languages.index_fill_(0, rows, 0)

    # -- gather / scatter -------------------------------------------------------------------------
    def gather_encoder(self, rows: torch.Tensor) -> EncoderCache:
        """The rows' encoder caches. The attention cache lands in a buffer reused by every
        gather (valid until the next one): a fresh tensor this size (80 MB at FastConformer-L,
        batch 32) costs more in page faults than the copy itself on CPU."""
        return EncoderCache(
            self._gather_channel(rows),
            self.cache_last_time.index_select(1, rows),
            self.cache_last_channel_len.index_select(0, rows),
        )

    def _gather_channel(self, rows: torch.Tensor) -> torch.Tensor:
        src = self.cache_last_channel
        shape = (src.shape[0], len(rows), *src.shape[2:])
        numel = shape[0] * shape[1] * src[0, 0].numel()
        if self._channel_buf is None or self._channel_buf.numel() < numel:
            self._channel_buf = torch.empty(numel, dtype=src.dtype, device=src.device)
        out = self._channel_buf[:numel].view(shape)
        return torch.index_select(src, 1, rows, out=out)

    def scatter_encoder(self, rows: torch.Tensor, cache: EncoderCache) -> None:
        src, dst = cache.cache_last_channel, self.cache_last_channel
        if src.shape[-2] != dst.shape[-2]:  # the KV layout's scratch positions are not state
            dst = dst.narrow(-2, 0, src.shape[-2])
        dst.index_copy_(1, rows, src.to(dst.dtype))
        self.cache_last_time.index_copy_(1, rows, cache.cache_last_time.to(self.cache_last_time.dtype))
        self.cache_last_channel_len.index_copy_(0, rows, cache.cache_last_channel_len)

    def gather_decoder(self, rows: torch.Tensor) -> BatchedLabelLoopingState:
        return BatchedLabelLoopingState(
            predictor_states=[s.index_select(1, rows) for s in self.predictor_states],
            predictor_outputs=self.predictor_outputs.index_select(0, rows),
            labels=self.labels.index_select(0, rows),
            decoded_lengths=self.decoded_lengths.index_select(0, rows),
        )

    def scatter_decoder(self, rows: torch.Tensor, state: BatchedLabelLoopingState) -> None:
        n = len(rows)
        for dst, src in zip(self.predictor_states, state.predictor_states):
            dst.index_copy_(1, rows, src[:, :n])
        self.predictor_outputs.index_copy_(0, rows, state.predictor_outputs[:n])
        self.labels.index_copy_(0, rows, state.labels[:n])
        self.decoded_lengths.index_copy_(0, rows, state.decoded_lengths[:n])

    def gather_history(self, rows: torch.Tensor) -> torch.Tensor:
        return self.feature_history.index_select(0, rows)  # [B, F, 9]

    def scatter_history(self, rows: torch.Tensor, history: torch.Tensor) -> None:
        self.feature_history.index_copy_(0, rows, history)
