"""The scheduler driven without an engine (test_scheduler.py, test_latency_modes.py)."""

from __future__ import annotations

import numpy as np

from nemo_serve.engine.scheduler import Scheduler


class SchedulerAlone(Scheduler):
    """A scheduler driven without an engine: which slots are open is its own mask here (in an
    engine, the slot table's `held`, which the engine passes to plan)."""

    def __init__(self, geometry, num_slots: int, max_batch: int, margin_samples: int) -> None:
        super().__init__(geometry, num_slots, max_batch, margin_samples)
        self.held = np.zeros(num_slots, bool)

    def admit(self, slot: int, geometry=None) -> None:
        super().admit(slot, geometry)
        self.held[slot] = True

    def release(self, slot: int) -> None:
        self.held[slot] = False

    def plan(self, now: float):
        return super().plan(now, self.held)
