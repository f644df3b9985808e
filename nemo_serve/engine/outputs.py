"""What one `Engine.iterate()` produced: the engine's only way out.

The engine calls nobody back. Whoever drives `iterate()` routes what it returns: the engine
core (core/engine_core.py) frees the released streams' slots, publishes the queue delay and
returns the updates per front end, which core/core_proc.py sends over ZMQ and core/inproc.py
hands to the streams' consumers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .results import StreamUpdate


@dataclass(frozen=True)
class StepStats:
    """One batched step: its rows, how long it took, the chunk mode its rows share."""

    batch_size: int
    elapsed_s: float
    context_right: int | None


@dataclass(frozen=True)
class ReleasedStream:
    """A stream whose slot (cache row) is free again: nothing more comes for it."""

    stream_id: str
    slot: int


@dataclass(frozen=True)
class IterationOutput:
    updates: tuple[StreamUpdate, ...]  # in the order produced
    update_slots: tuple[int, ...]  # the slot of each update's stream (what the core routes by)
    released: tuple[ReleasedStream, ...]
    steps: tuple[StepStats, ...]
    queue_delay: tuple[float, float]  # (seconds behind real time, valid until): engine/queue_delay.py
    in_flight: int = 0  # steps launched and not yet collected (Engine overlap): their results come next
    diarized_rows: int = 0  # rows of this iteration's diarizer step (0: none ran)

    @property
    def busy(self) -> bool:
        """A stream advanced or a step is in flight: the caller should iterate again without sleeping."""
        return bool(self.steps) or self.in_flight > 0 or self.diarized_rows > 0

