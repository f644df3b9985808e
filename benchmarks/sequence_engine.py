"""A stand-in Engine for the ring benchmarks and tests: it copies every sample it is handed out of
the ring, as the Engine does, and checks it against its stream's sequence number (used by
benchmarks/ring_bench.py, benchmarks/ring_stress.py, tests/test_ring_wake.py, tests/test_core_io.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nemo_serve.engine.outputs import IterationOutput, ReleasedStream, StepStats  # noqa: E402 - torch-free
from nemo_serve.engine.results import StreamUpdate  # noqa: E402 - torch-free
from nemo_serve.engine.slot_table import SlotTable  # noqa: E402 - torch-free

SEQUENCE_MOD = 1 << 24  # float32 holds every integer below it exactly


def sequence(stream_id: str, start: int, n: int) -> np.ndarray:
    """Samples [start, start + n) of the stream's sequence: a stream-specific offset, so a sample
    from another ring is caught as surely as a stale one from this ring's previous lap."""
    base = int(stream_id.rsplit("-", 1)[-1]) * 7919
    return ((base + start + np.arange(n, dtype=np.int64)) % SEQUENCE_MOD).astype(np.float32)


class _Stream:
    def __init__(self, stream_id: str, slot: int, check: bool) -> None:
        self.stream_id, self.slot, self.check = stream_id, slot, check
        self.taken = 0
        self.error: str | None = None
        self.arrived = 0.0


class SequenceEngine:
    """Stands in for the Engine inside an EngineCore (the calls EngineCore makes): copies every
    sample it is handed out of the ring, as the Engine does, and with `check` compares it with its
    stream's sequence; a stream's last update reports how many samples it took and the first
    mismatch."""

    def __init__(self, num_slots: int, check: bool = True) -> None:
        self.check = check
        self.num_slots = num_slots
        self.slots = SlotTable(num_slots)
        self._ending: list[_Stream] = []
        self._released: list[ReleasedStream] = []

    def admit(self, *, stream_id: str, slot: int, **_) -> _Stream:
        stream = _Stream(stream_id, slot, self.check)
        self.slots.take(stream, slot)
        return stream

    def take_audio(self, s: _Stream, parts, arrived: float) -> None:
        got = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        if s.check and s.error is None:
            want = sequence(s.stream_id, s.taken, len(got))
            bad = np.flatnonzero(got != want)
            if bad.size:
                i = int(bad[0])
                s.error = f"sample {s.taken + i}: got {got[i]:.0f}, sent {want[i]:.0f}"
        s.taken += len(got)
        s.arrived = arrived

    def take_audio_many(self, slots: np.ndarray, parts: list, arrivals: list[float]) -> None:
        """What EngineCore calls once per iteration (Engine.take_audio_many)."""
        for slot, pieces, arrived in zip(slots.tolist(), parts, arrivals):
            self.take_audio(self.slots.by_slot[slot], pieces, arrived)

    def finish(self, s: _Stream) -> None:
        self._ending.append(s)

    def abort(self, s: _Stream, reason: str = "aborted") -> None:
        self.slots.give_back(s)
        self._released.append(ReleasedStream(s.stream_id, s.slot))

    def force_final(self, s: _Stream) -> None:
        pass

    def iterate(self) -> IterationOutput:
        ending, self._ending = self._ending, []
        updates = tuple(
            StreamUpdate(s.stream_id, 0, True, True, [], [], 0, float(s.taken), s.arrived, error=s.error) for s in ending
        )
        for s in ending:
            self.slots.give_back(s)
        released = tuple(self._released) + tuple(ReleasedStream(s.stream_id, s.slot) for s in ending)
        self._released.clear()
        steps = tuple(StepStats(1, 0.0, 0) for _ in ending)  # busy: the core should not sleep
        return IterationOutput(updates, tuple(s.slot for s in ending), released, steps, (0.0, 0.0))


def model_info():
    """What an EngineClient needs of the model: nothing of it is used by the rings."""
    from nemo_serve.engine.geometry import ChunkGeometry, ModelInfo

    g = ChunkGeometry(70, 0, 1, 8, 9, 2, 1, 8, 160, 16000, 8)
    return ModelInfo("ring-bench", g, ["<blank>"], False, None, None, 400, "ring bench")
