"""Shared memory between the engine core and the front ends: the slot table and audio rings.

One block, created by the supervisor, attached by every process:

  state      int64[4]       core state (STARTING, SERVING, STOPPED, FAILED), stream-steps, steps
  heartbeat  float64[1]     core's time.time() at its last loop iteration
  queue_delay float64[2]    how far behind real time the engine recently was, and until when that
                            holds (engine/queue_delay.py): what admission reads for overload
  owner      int32[S]       front end holding the slot (-1: free); changed under `lock` only
  gen        int64[S]       bumped at every allocation: control messages carry it, so a late
                            message for a slot's previous stream is recognised and ignored
  write_pos  int64[S]       samples written into the slot's ring (front end; grows forever)
  read_pos   int64[S]       samples the core has taken out of it (core)
  arrival    float64[S]     time.time() when the front end wrote the newest samples (latency)
  ring       float32[S, N]  the audio, at the model's sample rate, sample i at i % N

A slot is allocated by a front end at admission (so a full server refuses at once, without a
round trip to the core) and freed by the core once it has released the stream. One writer per
ring and one reader: the front end writes samples, then advances write_pos; the core reads
write_pos, then the samples (x86-64 keeps stores in order; see DESIGN).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from ..engine.errors import NoFreeSlotError

STARTING, SERVING, STOPPED, FAILED = 0, 1, 2, 3
FREE = -1


@dataclass(frozen=True)
class SharedLayout:
    num_slots: int
    ring_samples: int

    def _fields(self):
        s, n = self.num_slots, self.ring_samples
        return [
            ("state", np.int64, (4,)),
            ("heartbeat", np.float64, (1,)),
            ("queue_delay", np.float64, (2,)),
            ("owner", np.int32, (s,)),
            ("mode", np.int32, (s,)),  # the holder's chunk mode (right context), for /readyz
            ("gen", np.int64, (s,)),
            ("write_pos", np.int64, (s,)),
            ("read_pos", np.int64, (s,)),
            ("arrival", np.float64, (s,)),
            ("ring", np.float32, (s, n)),
        ]

    @property
    def nbytes(self) -> int:
        return sum(_aligned(np.dtype(t).itemsize * int(np.prod(shape))) for _, t, shape in self._fields())


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


class FileLock:
    """An exclusive flock on a file: released by the kernel if its holder dies (a crashed front
    end cannot leave the slot table locked), and no semaphore for a resource tracker to leak.
    Picklable (by path); each process opens the file on first use."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def __getstate__(self):
        return {"path": self.path, "_fd": None}

    def __enter__(self) -> "FileLock":
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


class SharedSlots:
    """Views on the block; `create` in the supervisor, `attach` everywhere else."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: SharedLayout, lock, owner_of_block: bool) -> None:
        self.shm = shm
        self.layout = layout
        self.lock = lock  # FileLock guarding allocation and freeing
        self._owner_of_block = owner_of_block
        self.num_slots = layout.num_slots
        self.ring_samples = layout.ring_samples
        offset = 0
        for name, dtype, shape in layout._fields():
            arr = np.ndarray(shape, dtype=dtype, buffer=shm.buf, offset=offset)
            setattr(self, name, arr)
            offset += _aligned(arr.nbytes)

    @classmethod
    def create(cls, layout: SharedLayout, lock) -> "SharedSlots":
        shm = shared_memory.SharedMemory(create=True, size=layout.nbytes)
        self = cls(shm, layout, lock, owner_of_block=True)
        self.state[:] = 0
        self.queue_delay[:] = 0.0
        self.owner[:] = FREE
        self.gen[:] = 0
        self.write_pos[:] = 0
        self.read_pos[:] = 0
        return self

    @classmethod
    def attach(cls, name: str, layout: SharedLayout, lock) -> "SharedSlots":
        # Spawned children share their parent's resource tracker: attaching registers the name
        # again (a no-op), and only the creator's close() unlinks it.
        shm = shared_memory.SharedMemory(name=name)
        return cls(shm, layout, lock, owner_of_block=False)

    @property
    def name(self) -> str:
        return self.shm.name

    def close(self) -> None:
        for name, _, _ in self.layout._fields():
            setattr(self, name, None)  # drop the views before the mapping goes
        self.shm.close()
        if self._owner_of_block:
            self.shm.unlink()

    def queue_delay_s(self, now: float) -> float:
        """How far behind real time the core recently was; 0 once it has not stepped for a while."""
        value, valid_until = self.queue_delay.tolist()
        return value if now <= valid_until else 0.0

    # -- slot table -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return int(np.count_nonzero(self.owner == FREE))

    def allocate(self, frontend: int, mode: int = 0) -> tuple[int, int]:
        """(slot, generation) now held by `frontend` for a stream of chunk mode `mode`, or NoFreeSlotError."""
        with self.lock:
            free = np.flatnonzero(self.owner == FREE)
            if free.size == 0:
                raise NoFreeSlotError(f"all {self.num_slots} slots are in use")
            slot = int(free[0])
            self.gen[slot] += 1
            self.write_pos[slot] = 0
            self.read_pos[slot] = 0
            self.owner[slot] = frontend
            self.mode[slot] = mode
            return slot, int(self.gen[slot])

    def open_by_mode(self) -> dict[int, int]:
        """Slots held, by chunk mode (every front end's streams)."""
        modes, counts = np.unique(self.mode[self.owner != FREE], return_counts=True)
        return dict(zip(modes.tolist(), counts.tolist()))

    def free(self, slots) -> None:
        with self.lock:
            self.owner[np.asarray(slots, dtype=np.int64)] = FREE

    # -- audio ring -------------------------------------------------------------------------------
    def space(self, slot: int) -> int:
        return self.ring_samples - int(self.write_pos[slot] - self.read_pos[slot])

    def write(self, slot: int, samples: np.ndarray, now: float) -> None:
        """Front end: append samples (the caller checked `space`)."""
        n = len(samples)
        w = int(self.write_pos[slot])
        i = w % self.ring_samples
        first = min(n, self.ring_samples - i)
        ring = self.ring[slot]
        ring[i : i + first] = samples[:first]
        if first < n:
            ring[: n - first] = samples[first:]
        self.arrival[slot] = now
        self.write_pos[slot] = w + n  # last: the core reads the position, then the samples

    def views(self, slot: int, end: int) -> tuple[np.ndarray, ...]:
        """Core: samples [read_pos, end) as one or two views of the ring (no copy). The caller
        copies them out, then calls `consume`: until then the front end cannot overwrite them."""
        r = int(self.read_pos[slot])
        i, j = r % self.ring_samples, end % self.ring_samples
        ring = self.ring[slot]
        return (ring[i:j],) if i < j or end == r else (ring[i:], ring[:j])

    def consume(self, slot: int, end: int) -> None:
        self.read_pos[slot] = end

    def read(self, slot: int, end: int) -> np.ndarray:
        """Core: samples [read_pos, end) as a new array; advances read_pos."""
        parts = self.views(slot, end)
        out = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        self.consume(slot, end)
        return out
