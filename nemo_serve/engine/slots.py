"""The slot pool: every open stream's encoder caches and RNN-T decoder state, preallocated.

One row (slot) per stream in fixed tensors, allocated once at start-up, plus one scratch row
(`pool.scratch`, index `num_slots`) that padded rows of a bucketed step point at: its state is
garbage and its results are discarded. A step gathers the rows of its streams with
`index_select`, runs the model on the dense batch, and writes the new state back with
`index_copy_`. Which stream holds which row is the slot table's (engine/slot_table.py); the pool
only opens a row for a stream and resets it afterwards. Only the step loop thread touches it.

Nothing here waits for the device. A freed row is queued and reset with the other rows freed since
the last step, in one batch, when the next step (or gather) calls `flush()`; the row indices reach
the device through a pinned host buffer and a non-blocking copy. A slot's language is written with
a device-side fill. The gathered attention cache lands in one buffer sized once for the largest
step (`max_step_rows`, engine/buckets.py), not grown with the batch.

Why slot tensors and not per-stream tensors stacked each step (sherpa-onnx's StackStates, NeMo's
Hypothesis.dec_state): the gather is one kernel per tensor whatever the batch, and a freed
stream costs a row reset instead of an allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from nemo.collections.asr.parts.submodules.transducer_decoding.label_looping_base import BatchedLabelLoopingState

from ..nemo_private import decoder_state_after_sos
from .buckets import max_step_rows


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class EncoderCache:
    cache_last_channel: torch.Tensor  # [L, B, C, D] layer inputs (NeMo's layout) or [L, B, ...] (engine/encoder.py)
    cache_last_time: torch.Tensor  # [L, B, D, K-1]
    cache_last_channel_len: torch.Tensor  # [B]


class SlotPool:
    """Owns the cache tensors, one row per slot (engine/slot_table.py says which stream holds it)."""

    layout = "window"  # whole windows gathered and scattered per step (engine/ring_cache.py: "ring")

    def __init__(
        self,
        model,
        num_slots: int,
        channel_shape: tuple[int, ...] | None = None,
        max_rows: int | None = None,
    ) -> None:
        """`channel_shape`: one stream's attention cache after the layer axis (default NeMo's [C, D]).
        `max_rows`: rows one step may run (default: what the step cache budget allows,
        engine/buckets.py); larger ready sets are split into several steps."""
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self.scratch = num_slots  # the padded rows' slot
        rows = num_slots + 1
        dev, dtype = model.device, model.dtype
        self.device = dev
        (n_layers, c, d), (_, d2, k) = model.cache_shapes
        self._allocate_encoder_caches(n_layers, rows, channel_shape or (c, d), (d2, k), dtype)
        self.cache_last_channel_len = torch.zeros(rows, device=dev, dtype=torch.long)  # [S+1]
        # Decoder state after <SOS>, one row; a fresh slot is reset to it.
        sos = decoder_state_after_sos(model.decoding_computer, dev, batch_size=1)
        self._sos = sos
        self.predictor_states = [s.repeat(1, rows, 1).contiguous() for s in sos.predictor_states]  # [layers, S+1, H]
        self.predictor_outputs = sos.predictor_outputs.repeat(rows, 1, 1).contiguous()  # [S+1, 1, J]
        self.labels = sos.labels.repeat(rows).contiguous()  # [S+1]
        self.decoded_lengths = torch.zeros(rows, device=dev, dtype=torch.long)  # [S+1]
        if sos.fusion_states_list:
            raise ValueError("LM fusion / biasing states are not supported by the slot pool")
        # Feature history: the last pre-encode-cache frames each later chunk is prefixed with.
        g = model.geometry
        self.feature_history = torch.zeros(rows, model.num_mels, g.pre_cache_frames, device=dev)  # [S+1, F, 9]
        self.languages = torch.zeros(rows, device=dev, dtype=torch.long)  # [S+1]
        # Phrase boosting (engine/biasing.py): each row's multi-model id (-1: none; always for the
        # scratch row) and its boosting-tree state; a host copy of "has an id" lets a step without
        # boosted rows run the plain decoder.
        self.biasing_ids = torch.full((rows,), -1, device=dev, dtype=torch.long)  # [S+1]
        self.biasing_states = torch.zeros(rows, device=dev, dtype=torch.long)  # [S+1]
        self.boosted = np.zeros(rows, dtype=bool)  # [S+1] host
        self.biasing = None  # the BiasingRegistry, made by the engine for its first boosted stream
        self.max_step_rows = max_rows or max_step_rows(num_slots, self.gather_bytes_per_row)
        # gather_encoder's output: one buffer for the largest step, allocated here, never grown.
        self._channel_buf = torch.empty(self.max_step_rows * self.gather_bytes_per_row // dtype.itemsize, device=dev, dtype=dtype)
        # Freed rows waiting for their reset (flush): host staging (pinned on CUDA) -> device.
        self._to_reset: list[int] = []
        pin = dev.type == "cuda"
        self._reset_host = torch.empty(rows, dtype=torch.long, pin_memory=pin)
        self._reset_dev = torch.empty(rows, dtype=torch.long, device=dev)
        self._reset_event = None  # CUDA: the last reset copy; the host buffer is reused after it
        # The steppers that run steps over these rows, one per chunk mode, built on first use by
        # engine/step.py `stepper_for`: their staging buffers are sized for this pool and their
        # CUDA graphs hold its tensors' addresses, so they belong to the pool and die with it.
        self.steppers: dict = {}  # context_right -> step.Stepper (not imported: step.py imports this module)

    def _allocate_encoder_caches(self, n_layers: int, rows: int, shape: tuple, time_shape: tuple, dtype) -> None:
        """The attention and convolution caches, every layer in one tensor each (engine/ring_cache.py
        lays them out per layer instead)."""
        dev = self.device
        self.cache_last_channel = torch.zeros(n_layers, rows, *shape, device=dev, dtype=dtype)  # [L, S+1, *shape]
        self.cache_last_time = torch.zeros(n_layers, rows, *time_shape, device=dev, dtype=dtype)  # [L, S+1, D, K-1]

    def _encoder_tensors(self) -> list[torch.Tensor]:
        """The encoder caches with a layer axis first and a slot axis second."""
        return [self.cache_last_channel, self.cache_last_time]

    @property
    def cache_bytes_per_stream(self) -> int:
        """Encoder cache bytes one slot holds (attention + convolution caches)."""
        return sum(x[:, 0].numel() * x.element_size() for x in self._encoder_tensors())

    @property
    def gather_bytes_per_row(self) -> int:
        """Bytes of one row of the gathered attention cache (what the gather buffer holds per row)."""
        return self.cache_last_channel[:, 0].numel() * self.cache_last_channel.element_size()

    def _slot_tensors(self) -> list[torch.Tensor]:
        return [
            *self._encoder_tensors(), self.cache_last_channel_len, *self.predictor_states,
            self.predictor_outputs, self.labels, self.decoded_lengths, self.feature_history, self.languages,
            self.biasing_ids, self.biasing_states,
        ]

    @property
    def bytes_per_slot(self) -> int:
        """Everything one stream holds: encoder caches, fill level, decoder state, feature history,
        language."""
        total = 0
        for t in self._slot_tensors():
            axis = 1 if t.dim() >= 2 and t.shape[0] != self.num_slots + 1 else 0
            total += t.numel() // t.shape[axis] * t.element_size()
        return total

    @property
    def fixed_bytes(self) -> int:
        """What does not scale with the slots: the scratch row and the step's gather buffer."""
        return self.bytes_per_slot + self._channel_buf.numel() * self._channel_buf.element_size()

    def memory_summary(self) -> str:
        """Per stream, at the configured slots, and (CUDA) the most slots the device's memory would hold."""
        per, fixed = self.bytes_per_slot, self.fixed_bytes
        line = (
            f"state {per / 2**20:.2f} MiB/stream x {self.num_slots} slots = {_size(per * self.num_slots)}"
            f" + {_size(fixed)} fixed (gather buffer for {self.max_step_rows} rows per step, scratch row)"
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            line += f"; {free / 2**30:.1f} of {total / 2**30:.1f} GiB free: room for ~{self.num_slots + free // per:,} slots"
            line += " before activations"
        return line

    # -- rows -------------------------------------------------------------------------------------
    @property
    def num_boosted(self) -> int:
        return int(self.boosted.sum())

    def any_boosted(self, rows) -> bool:
        """Whether any of `rows` (numpy, or a tensor: then the whole pool is asked) has phrases."""
        if isinstance(rows, np.ndarray):
            return bool(self.boosted[rows].any())
        return bool(self.boosted.any())

    def open_row(self, slot: int, language_index: int = 0, biasing_id: int = -1, biasing_state: int = 0) -> None:
        """A new stream's row (fresh state: reset when its previous stream's was closed)."""
        self.languages[slot].fill_(language_index)  # a device-side fill: no host->device copy
        # Set on every allocation, like the language: a row freed and taken again before the next
        # flush would otherwise keep its previous stream's tree.
        self.biasing_ids[slot].fill_(biasing_id)
        self.biasing_states[slot].fill_(biasing_state)
        self.boosted[slot] = biasing_id >= 0

    def close_row(self, slot: int) -> None:
        """The row's stream is gone: the row is reset at the next `flush()` (before any step or
        gather reads it), with every other row closed meanwhile."""
        self._to_reset.append(slot)
        self.boosted[slot] = False

    def flush(self) -> None:
        """Reset the rows freed since the last flush: one batch, no wait for the device."""
        if not self._to_reset:
            return
        slots = sorted(set(self._to_reset))
        self._to_reset = []
        n = len(slots)
        if self._reset_event is not None:
            self._reset_event.synchronize()  # the previous copy has read the host buffer (long done)
        self._reset_host[:n] = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        rows = self._reset_dev[:n]
        rows.copy_(self._reset_host[:n], non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._reset_event = torch.cuda.Event()
            self._reset_event.record()
        self._reset_rows(rows)

    def _reset_rows(self, rows: torch.Tensor) -> None:
        """The rows' state back to a fresh stream's. Languages and biasing are not touched: `allocate` sets them."""
        self._reset_encoder_rows(rows)
        self.cache_last_channel_len.index_fill_(0, rows, 0)
        n = len(rows)
        for dst, src in zip(self.predictor_states, self._sos.predictor_states):
            dst.index_copy_(1, rows, src.expand(-1, n, -1))
        self.predictor_outputs.index_copy_(0, rows, self._sos.predictor_outputs.expand(n, -1, -1))
        self.labels.index_copy_(0, rows, self._sos.labels.expand(n))
        self.decoded_lengths.index_fill_(0, rows, 0)
        self.feature_history.index_fill_(0, rows, 0.0)

    def _reset_encoder_rows(self, rows: torch.Tensor) -> None:
        self.cache_last_channel.index_fill_(1, rows, 0.0)
        self.cache_last_time.index_fill_(1, rows, 0.0)

    def read_encoder(self, rows: torch.Tensor, cache_len: int | None = None) -> EncoderCache:
        """A copy of the rows' encoder caches as state (tests compare layouts with it): the
        attention cache's first `cache_len` positions (the KV layout's scratch positions are
        not state; None: all)."""
        self.flush()
        channel = self.cache_last_channel.index_select(1, rows)
        if cache_len is not None:
            channel = channel.narrow(-2, 0, cache_len)
        return EncoderCache(
            channel.contiguous(), self.cache_last_time.index_select(1, rows),
            self.cache_last_channel_len.index_select(0, rows),
        )

    # -- gather / scatter -------------------------------------------------------------------------
    def gather_encoder(self, rows: torch.Tensor) -> EncoderCache:
        """The rows' encoder caches. The attention cache lands in a buffer reused by every
        gather (valid until the next one): a fresh tensor this size (80 MB at FastConformer-L,
        batch 32) costs more in page faults than the copy itself on CPU. At most `max_step_rows`."""
        self.flush()
        return EncoderCache(
            self._gather_channel(rows),
            self.cache_last_time.index_select(1, rows),
            self.cache_last_channel_len.index_select(0, rows),
        )

    def _gather_channel(self, rows: torch.Tensor) -> torch.Tensor:
        src = self.cache_last_channel
        if len(rows) > self.max_step_rows:
            raise ValueError(f"{len(rows)} rows in one gather; this pool's steps take at most {self.max_step_rows}")
        shape = (src.shape[0], len(rows), *src.shape[2:])
        out = self._channel_buf[: shape[0] * shape[1] * src[0, 0].numel()].view(shape)
        return torch.index_select(src, 1, rows, out=out)

    def scatter_encoder(self, rows: torch.Tensor, cache: EncoderCache) -> None:
        src, dst = cache.cache_last_channel, self.cache_last_channel
        if src.shape[-2] != dst.shape[-2]:  # the KV layout's scratch positions are not state
            dst = dst.narrow(-2, 0, src.shape[-2])
        dst.index_copy_(1, rows, src.to(dst.dtype))
        self.cache_last_time.index_copy_(1, rows, cache.cache_last_time.to(self.cache_last_time.dtype))
        self.cache_last_channel_len.index_copy_(0, rows, cache.cache_last_channel_len)

    def gather_decoder(self, rows: torch.Tensor, boosted: bool = False) -> BatchedLabelLoopingState:
        """`boosted`: also the rows' boosting-tree states, as the biasing decoder's one fusion state."""
        self.flush()
        return BatchedLabelLoopingState(
            predictor_states=[s.index_select(1, rows) for s in self.predictor_states],
            predictor_outputs=self.predictor_outputs.index_select(0, rows),
            labels=self.labels.index_select(0, rows),
            decoded_lengths=self.decoded_lengths.index_select(0, rows),
            fusion_states_list=[self.biasing_states.index_select(0, rows)] if boosted else [],
        )

    def scatter_decoder(self, rows: torch.Tensor, state: BatchedLabelLoopingState) -> None:
        n = len(rows)
        for dst, src in zip(self.predictor_states, state.predictor_states):
            dst.index_copy_(1, rows, src[:, :n])
        self.predictor_outputs.index_copy_(0, rows, state.predictor_outputs[:n])
        self.labels.index_copy_(0, rows, state.labels[:n])
        self.decoded_lengths.index_copy_(0, rows, state.decoded_lengths[:n])
        if state.fusion_states_list:
            self.biasing_states.index_copy_(0, rows, state.fusion_states_list[0][:n])

    def gather_history(self, rows: torch.Tensor) -> torch.Tensor:
        self.flush()
        return self.feature_history.index_select(0, rows)  # [B, F, 9]

    def scatter_history(self, rows: torch.Tensor, history: torch.Tensor) -> None:
        self.feature_history.index_copy_(0, rows, history)
