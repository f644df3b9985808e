"""What the step bench records of one system over one lockstep batch of streams, and its clock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Measurement:
    system: str
    batch: int
    timed_steps: int  # batched calls timed (per-stream loop: sweeps over the B streams)
    seconds: float  # wall time of the timed steps, features included (see module docstring)
    cpu_seconds: float  # process CPU time of the same (robust to a busy neighbour on a shared machine)
    feature_s: float  # part of `seconds` spent on features computed outside the step
    step_times_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def stream_steps_per_s(self) -> float:
        return self.batch * self.timed_steps / self.seconds if self.seconds > 0 else float("nan")

    @property
    def stream_steps_per_cpu_s(self) -> float:
        return self.batch * self.timed_steps / self.cpu_seconds if self.cpu_seconds > 0 else float("nan")


def clock() -> tuple[float, float]:
    """(wall, process CPU) seconds now. With one thread everything runs in this process, so CPU
    time is what the step costs when it has a core to itself; wall time includes waiting for one."""
    return time.perf_counter(), time.process_time()


def since(t: tuple[float, float]) -> tuple[float, float]:
    w, c = clock()
    return w - t[0], c - t[1]


def _steady(times: list) -> list:
    """Drop the first and the last step (see module docstring)."""
    if len(times) < 3:
        raise ValueError("need at least 3 chunks per stream to time a steady step; use longer audio")
    return times[1:-1]


def measurement(system: str, b: int, times: list[tuple[float, float]], tokens, features=(0.0, 0.0), num_calls=None) -> Measurement:
    """Steady steps of `times` [(wall, cpu)], plus their share of features computed up front."""
    steady = _steady(times)
    share = len(steady) / (num_calls or len(times))
    fw, fc = features[0] * share, features[1] * share
    return Measurement(
        system, b, len(steady),
        sum(w for w, _ in steady) + fw, sum(c for _, c in steady) + fc, fw,
        [w for w, _ in steady], tokens,
    )  # fmt: skip
