"""Shared memory between the engine core and the front ends: the slot table and audio rings.

One block, created by the supervisor, attached by every process:

  state      int64[4]       core state (STARTING, SERVING, STOPPED, FAILED), stream-steps, steps
  heartbeat  float64[1]     core's time.time() at its last loop iteration
  queue_delay float64[2]    how far behind real time the engine recently was, and until when that
                            holds (engine/queue_delay.py): what admission reads for overload
  guard      float64[3]     the core's overload guard (admission.py), shared by its front
                            ends: recovering cap (NaN: none), over the limit (0/1), time of the
                            last decision (NaN: none); read and written under `lock` only
  owner      int32[S]       front end holding the slot (-1: free); changed under `lock` only
  mode       int32[S]       the holder's chunk mode (right context), for /readyz
  gen        int64[S]       bumped at every allocation: control messages carry it, so a late
                            message for a slot's previous stream is recognised and ignored
  ring       float32[S, N]  the audio, at the model's sample rate: a stream's sample i at i % N

A positional forced final (engine/forced_ends.py) must reach the core before the audio past its
sample. A message is ordered after the Wrotes before it, but a position stored here is not ordered
after a message still in ZMQ's hands: so with shared positions the writer also counts its
positional ForceFinals here (`forced`, stored before any later position), and the core takes no
new audio of a slot whose count is ahead of the ForceFinals it has received (engine_core.py).

A slot is allocated by a front end at admission (so a full server refuses at once, without a
round trip to the core) and freed by the core once it has released the stream.

Publication: two ways, one chosen per block (SharedLayout.positions_in_shared; the server's is
ring_layout()'s, NEMO_SERVE_RING_POSITIONS). A ring has one writer (the front end holding the slot)
and one reader (the core).

`messages` (the old way; the default off x86-64). Neither position lives here: the writer tells
the reader how far it has written in a `Wrote` control message, and the reader tells the writer
how far it has read in its `Results` message (core/messages.py). Each message is sent after the
accesses it announces and received before the accesses that rely on it; ZMQ's hand-offs are
release/acquire pairs, so this is message passing, correct on any CPU without a barrier of ours.
Its cost: a message and a ZMQ I/O-thread wake-up per event-loop tick each way
(benchmarks/ring_bench.py, benchmarks/packet_cost.py).

`shared` (vLLM's way for its shared-memory queues; the default on x86-64). The positions live
here: `write_end` (and `arrival`) stored by the writer after the samples, `read_end` stored by the
core after it copied them out; the core reads every held slot's `write_end` when it plans, the
writer reads its `read_end` when it needs ring space. No message per packet: the only one is a
`Wake` to a core that is asleep (`core_asleep`, below). `fence()` orders each store after the
accesses it publishes and each load before the accesses that rely on it: on x86-64 (TSO) only the
store-then-load of the wake-up needs it; on aarch64 the positions would need it too, and the
fence's strength there rests on the C library's semaphore atomics, not checked on such a machine:
that is why the default is `messages` off x86-64.

Wake-up (shared positions). The core polls the positions every core_proc.POLL_MS while audio
flows (the same delay a Wrote had, client.WROTE_PERIOD_S). When none has moved for a while it
sleeps longer: it stores a fresh epoch in `core_asleep`, fences, looks at the positions and its
inbox once more, and only then blocks on its inbox; a writer stores its position, fences, and
reads `core_asleep`: non-zero and not yet woken by it, it sends one `Wake`. Either the core's
second look sees the position, or the writer sees the epoch (the fences forbid both missing:
Dekker's pattern), so no audio waits for the sleep's timeout (tests/test_ring_wake.py).

The slot table (owner, gen, mode) and the guard change under `lock`, an flock whose kernel lock
orders them as well; a slot freed by the core is reused by a front end only through that lock, so
the core's last reads of a ring happen before the next stream's writes. `state`, `heartbeat` and
`queue_delay` are single values read for monitoring; they publish nothing else.
"""

from __future__ import annotations

import fcntl
import os
import platform
import threading
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from ..engine.errors import NoFreeSlotError
from ..admission import GuardState

STARTING, SERVING, STOPPED, FAILED = 0, 1, 2, 3
FREE = -1


@dataclass(frozen=True)
class SharedLayout:
    num_slots: int
    ring_samples: int
    positions_in_shared: bool = False  # ring positions here, not in messages (module docstring)

    def _fields(self):
        s, n = self.num_slots, self.ring_samples
        return [
            ("state", np.int64, (4,)),
            ("heartbeat", np.float64, (1,)),
            ("queue_delay", np.float64, (2,)),
            ("guard", np.float64, (3,)),  # cap, over, last decision: admission.py GuardState
            ("owner", np.int32, (s,)),
            ("mode", np.int32, (s,)),  # the holder's chunk mode (right context), for /readyz
            ("gen", np.int64, (s,)),
            ("write_end", np.int64, (s,)),  # shared positions: the stream's generation and samples written (publish_write)
            ("arrival", np.float64, (s,)),  # shared positions: time.time() the newest written ones arrived
            ("read_end", np.int64, (s,)),  # shared positions: samples the core copied out (the space is free)
            ("core_asleep", np.int64, (1,)),  # shared positions: the core's sleep epoch, 0 while awake
            ("forced", np.int64, (s,)),  # shared positions: the stream's generation and positional forced finals sent (publish_forced)
            ("ring", np.float32, (s, n)),
        ]

    @property
    def nbytes(self) -> int:
        return sum(_aligned(np.dtype(t).itemsize * int(np.prod(shape))) for _, t, shape in self._fields())


def positions_in_shared_default() -> bool:
    """NEMO_SERVE_RING_POSITIONS=shared|messages; unset: shared on x86-64 only (module docstring)."""
    choice = os.environ.get("NEMO_SERVE_RING_POSITIONS", "")
    if choice not in ("", "shared", "messages"):
        raise ValueError(f"NEMO_SERVE_RING_POSITIONS={choice!r}: expected 'shared' or 'messages'")
    return choice == "shared" or (not choice and platform.machine().lower() in ("x86_64", "amd64"))


# A shared write position: the stream's generation (low 23 bits) over 40 bits of samples (two
# years at 16 kHz), one atomic 64-bit store.
_POS_BITS = 40
_POS_MASK = (1 << _POS_BITS) - 1
_GEN_MASK = (1 << 23) - 1

_FENCE_LOCK = threading.Lock()


def fence() -> None:
    """A full memory barrier, from Python: taking and giving back a lock is an atomic
    read-modify-write each (x86-64: a locked instruction, which orders every earlier load and store
    before every later one). About 0.2 us."""
    with _FENCE_LOCK:
        pass


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
        self.save_guard(GuardState())
        self.owner[:] = FREE
        self.gen[:] = 0
        self.core_asleep[:] = 0
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

    # -- overload guard (admission.OverloadGuard's store; the caller holds `lock`) ------------------
    def load_guard(self) -> GuardState:
        cap, over, last = self.guard.tolist()
        return GuardState(None if np.isnan(cap) else cap, bool(over), None if np.isnan(last) else last)

    def save_guard(self, state: GuardState) -> None:
        self.guard[:] = (np.nan if state.cap is None else state.cap, float(state.over),
                         np.nan if state.last is None else state.last)  # fmt: skip

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
            # Before the Open that hands the slot to the core, under the lock that orders it after
            # the core's last access for the previous stream.
            self.read_end[slot] = 0
            self.gen[slot] += 1
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
    # Positions count a stream's samples from 0 and grow forever; sample i sits at i % N. Who has
    # written and read how far travels in messages or lives here (see the module docstring).
    def publish_write(self, slot: int, gen: int, end: int, arrival: float) -> int:
        """Front end, shared positions: the slot's samples up to `end` are in its ring. Returns the
        core's sleep epoch as seen after the store (non-zero: it may be asleep; send a Wake).
        The position carries the stream's generation in one 64-bit store, as a Wrote carries it:
        a late store by a slot's previous stream (client._holds_slot's narrow window) is ignored."""
        fence()  # the samples before the position
        self.arrival[slot] = arrival
        self.write_end[slot] = (gen & _GEN_MASK) << _POS_BITS | end
        fence()  # the position before the look at the flag (the wake-up: module docstring)
        return int(self.core_asleep[0])

    def publish_forced(self, slot: int, gen: int, count: int) -> None:
        """Front end, shared positions: `count` positional ForceFinals sent for the slot's stream,
        stored after the send and before any later write position (module docstring)."""
        fence()
        self.forced[slot] = (gen & _GEN_MASK) << _POS_BITS | count

    def forced_sent(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Core, shared positions: positional ForceFinals sent for these slots' streams (0 where
        the count is another generation's). Loaded after the write ends it guards."""
        word = self.forced[slots]
        return np.where((word >> _POS_BITS) == (gens & _GEN_MASK), word & _POS_MASK, 0)

    def written(self, slots: np.ndarray, gens: np.ndarray, fallback: np.ndarray) -> np.ndarray:
        """Core, shared positions: the write ends of these slots' streams (at `gens`); `fallback`
        where the position is another generation's (the stream has not written yet)."""
        word = self.write_end[slots]
        ours = (word >> _POS_BITS) == (gens & _GEN_MASK)
        return np.where(ours, word & _POS_MASK, fallback)

    def write(self, slot: int, start: int, samples: np.ndarray) -> None:
        """Front end: samples [start, start + n) of the slot's stream (the caller knows they fit).
        One slice copy, two where the ring wraps; no slice of `samples` in the common case."""
        n, size = len(samples), self.ring_samples
        i = start % size
        ring = self.ring[slot]
        if i + n <= size:
            ring[i : i + n] = samples
        else:
            first = size - i
            ring[i:] = samples[:first]
            ring[: n - first] = samples[first:]

    def views(self, slot: int, start: int, end: int) -> tuple[np.ndarray, ...]:
        """Core: samples [start, end) as one or two views of the ring (no copy). The caller copies
        them out before it tells the front end that it has read them."""
        i, j = start % self.ring_samples, end % self.ring_samples
        ring = self.ring[slot]
        return (ring[i:j],) if i < j or end == start else (ring[i:], ring[:j])

    def read(self, slot: int, start: int, end: int) -> np.ndarray:
        """Samples [start, end) as a new array (tests and benchmarks)."""
        parts = self.views(slot, start, end)
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
