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
    def __init__(self, num_slots: int, *, spkcache_len: int, fifo_len: int, emb_dim: int, num_speakers: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):  # fmt: skip
        def zeros(*shape, dtype=dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.num_slots = num_slots
        self._state = DiarState(  # one table, allocated once; rows are zeroed in place on reuse
            spkcache=zeros(num_slots, spkcache_len, emb_dim),
            spkcache_preds=zeros(num_slots, spkcache_len, num_speakers),
            spkcache_lengths=zeros(num_slots, dtype=torch.long),
            fifo=zeros(num_slots, fifo_len, emb_dim),
            fifo_lengths=zeros(num_slots, dtype=torch.long),
            mean_sil_emb=zeros(num_slots, emb_dim),
            n_sil_frames=zeros(num_slots, dtype=torch.long),
        )
        self.stream_to_slot: dict[str, int] = {}  # stream_id -> slot
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first

    @classmethod
    def for_model(cls, model, num_slots: int, device=None) -> "SpeakerCacheSlots":
        modules = model.sortformer_modules
        return cls(num_slots, spkcache_len=modules.spkcache_len, fifo_len=modules.fifo_len,
                   emb_dim=modules.fc_d_model, num_speakers=modules.n_spk, device=device or model.device)  # fmt: skip

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
        for tensor in self._state.fields().values():
            tensor[slot].zero_()
        self.stream_to_slot[stream_id] = slot
        return slot

    def release(self, stream_id: str) -> None:
        """Idempotent: a stream released twice (abort after finish) frees its slot once."""
        slot = self.stream_to_slot.pop(stream_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        assert self.num_free + self.num_used == self.num_slots

    def gather(self, slots: torch.Tensor) -> DiarState:
        return DiarState(**{name: t.index_select(0, slots) for name, t in self._state.fields().items()})

    def scatter(self, slots: torch.Tensor, state: DiarState) -> None:
        for name, table in self._state.fields().items():
            table.index_copy_(0, slots, getattr(state, name))
