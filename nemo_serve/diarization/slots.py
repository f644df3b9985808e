"""Each stream's streaming Sortformer state, preallocated and indexed by slot.

One owner: `SpeakerCacheSlots` owns the state tensors, the stream-to-slot map and the free list;
only the loop thread calls it. What a slot holds is NeMo's async `StreamingSortformerState` for one
stream: the speaker cache (pre-encoder embeddings and the speaker probabilities they had when they
entered it), the FIFO of recent embeddings, the silence statistics (mean silence embedding and the
frame count behind it), with fill levels per slot. NeMo's FIFO predictions are not kept: its async
update rebuilds them from each step's predictions. Nor is a speaker permutation: NeMo permutes
speakers only in training (`permute_spk=self.training`), so at inference it is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class NoFreeSlot(RuntimeError):
    pass


@dataclass
class DiarState:
    """The state of a batch of rows, gathered from slots (shapes: B rows, D embedding, K speakers)."""

    spkcache: torch.Tensor  # [B, spkcache_len, D]
    spkcache_preds: torch.Tensor  # [B, spkcache_len, K]
    spkcache_lengths: torch.Tensor  # [B] long
    fifo: torch.Tensor  # [B, fifo_len, D]
    fifo_lengths: torch.Tensor  # [B] long
    mean_sil_emb: torch.Tensor  # [B, D]
    n_sil_frames: torch.Tensor  # [B] long

    def fields(self) -> dict[str, torch.Tensor]:
        return dict(self.__dict__)


class SpeakerCacheSlots:
    """The state table. The speaker cache and FIFO tables are wider than NeMo's state by the most one
    step appends (a pop-out, a chunk) plus one column that masked writes land in, so that a step
    appends in place, row offsets and all, without copying a row (see update.py)."""

    def __init__(self, num_slots: int, *, spkcache_len: int, fifo_len: int, emb_dim: int, num_speakers: int,
                 chunk_room: int, pop_room: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):  # fmt: skip
        def zeros(*shape, dtype=dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.num_slots, self.spkcache_len, self.fifo_len = num_slots, spkcache_len, fifo_len
        self.chunk_room, self.pop_room = chunk_room, pop_room  # frames one step may append / pop out
        self.tables = DiarState(  # one table, allocated once; rows are zeroed in place on reuse
            spkcache=zeros(num_slots, spkcache_len + pop_room + 1, emb_dim),
            spkcache_preds=zeros(num_slots, spkcache_len + pop_room + 1, num_speakers),
            spkcache_lengths=zeros(num_slots, dtype=torch.long),
            fifo=zeros(num_slots, fifo_len + chunk_room + 1, emb_dim),
            fifo_lengths=zeros(num_slots, dtype=torch.long),
            mean_sil_emb=zeros(num_slots, emb_dim),
            n_sil_frames=zeros(num_slots, dtype=torch.long),
        )
        # The fill levels again, on the host, advanced when a step is planned (update.py plan_update):
        # a step's widths and branches are decided from these without reading the device.
        self.host_cache_lengths = np.zeros(num_slots, np.int64)  # [S] = tables.spkcache_lengths
        self.host_fifo_lengths = np.zeros(num_slots, np.int64)  # [S] = tables.fifo_lengths
        self.stream_to_slot: dict[str, int] = {}  # stream_id -> slot
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first

    @classmethod
    def for_model(cls, model, num_slots: int, device=None) -> "SpeakerCacheSlots":
        """Sized for the model's current streaming settings (apply_settings first)."""
        return cls.for_modules(model.sortformer_modules, num_slots, device or model.device)

    @classmethod
    def for_modules(cls, m, num_slots: int, device="cpu") -> "SpeakerCacheSlots":
        pop_room = min(max(m.spkcache_update_period, m.chunk_len), m.chunk_len + m.fifo_len)  # NeMo's max_pop_out_len
        return cls(num_slots, spkcache_len=m.spkcache_len, fifo_len=m.fifo_len, emb_dim=m.fc_d_model,
                   num_speakers=m.n_spk, chunk_room=m.chunk_len, pop_room=pop_room, device=device)  # fmt: skip

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def num_used(self) -> int:
        return len(self.stream_to_slot)

    def acquire(self, stream_id: str) -> int:
        if stream_id in self.stream_to_slot:
            raise ValueError(f"stream {stream_id!r} already holds slot {self.stream_to_slot[stream_id]}")
        if not self._free_slots:
            raise NoFreeSlot(f"all {self.num_slots} diarization slots are in use")
        slot = self._free_slots.pop()
        for tensor in self.tables.fields().values():
            tensor[slot].zero_()
        self.host_cache_lengths[slot] = self.host_fifo_lengths[slot] = 0
        self.stream_to_slot[stream_id] = slot
        return slot

    def release(self, stream_id: str) -> None:
        """Idempotent: a stream released twice (abort after finish) frees its slot once."""
        slot = self.stream_to_slot.pop(stream_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        assert self.num_free + self.num_used == self.num_slots

    def problems(self) -> list[str]:
        """What disagrees in the table's books: each held slot once, none also free, free + held = all."""
        held, found = list(self.stream_to_slot.values()), []
        if len(set(held)) != len(held) or set(held) & set(self._free_slots):
            found.append(f"diarizer slots {sorted(held)} held, {sorted(self._free_slots)} free: one is both or twice")
        if self.num_free + self.num_used != self.num_slots:
            found.append(f"{self.num_free} diarizer slots free and {self.num_used} held of {self.num_slots}")
        # the host's fill levels against the device's (a read that waits for the device: checks only)
        t, held = self.tables, sorted(held)
        host = (self.host_cache_lengths[held].tolist(), self.host_fifo_lengths[held].tolist())
        device = (t.spkcache_lengths[held].tolist(), t.fifo_lengths[held].tolist())
        if host != device:
            found.append(f"diarizer slots {held}: host fill levels (cache, FIFO) {host}, device {device}")
        return found

    def gather(self, slots: torch.Tensor) -> DiarState:
        """A copy of the rows' state in NeMo's async shapes (for checks and hand-over; the step works in place)."""
        t = self.tables
        return DiarState(
            t.spkcache[slots, : self.spkcache_len], t.spkcache_preds[slots, : self.spkcache_len],
            t.spkcache_lengths[slots], t.fifo[slots, : self.fifo_len], t.fifo_lengths[slots],
            t.mean_sil_emb[slots], t.n_sil_frames[slots],
        )  # fmt: skip

    def load(self, slots: torch.Tensor, state: DiarState) -> None:
        """Put a NeMo-shaped state (zero past each row's fill, as NeMo keeps it) into the rows."""
        for name, table in self.tables.fields().items():
            value = getattr(state, name)
            table[slots] = 0
            if value.dim() == 3:
                table[slots, : value.shape[1]] = value
            else:
                table[slots] = value
        self.host_cache_lengths[slots.cpu().numpy()] = state.spkcache_lengths.cpu().numpy()
        self.host_fifo_lengths[slots.cpu().numpy()] = state.fifo_lengths.cpu().numpy()
