"""The engine paths a GPU run compares, as the environment that picks each, and the run's phase deadlines.

A path is five switches, each read where the engine builds the part it picks (engine/ring_cache.py,
attention.py, step.py, epilogues.py, loop.py): KV layout, attention, decoder, epilogues, overlap.
gpu_bench.py's --selftest-configs spell them `layout:attention:decoder[:kernels[:overlap]]` (the
selftest's historical order) and --capacity-configs `layout:decoder[:attention[:kernels[:overlap]]]`;
what is left out is the faithful choice (matmul, nemo, 0).

--phase-ends gives each phase of gpu_bench.py the share of --budget-s by which it must have ended
("selftest:0.3,checks:0.48,..."): a phase starts no level, sweep or process that would run past its
end, so a phase that runs long cannot starve the ones after it (run_gpu.sh's time boxes).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

ENV = {"layout": "NEMO_SERVE_KV_LAYOUT", "attention": "NEMO_SERVE_ATTENTION", "decoder": "NEMO_SERVE_DECODER",
       "epilogues": "NEMO_SERVE_KERNELS", "overlap": "NEMO_SERVE_OVERLAP"}  # fmt: skip
FAITHFUL = {"attention": "matmul", "epilogues": "nemo", "overlap": "0"}
SELFTEST_ORDER = ("layout", "attention", "decoder", "epilogues", "overlap")
CAPACITY_ORDER = ("layout", "decoder", "attention", "epilogues", "overlap")
PHASES = ("selftest", "checks", "capacity", "overlap", "diarization")


@dataclass(frozen=True)
class EnginePath:
    layout: str
    attention: str
    decoder: str
    epilogues: str
    overlap: str

    @property
    def env(self) -> dict[str, str]:
        return {ENV[k]: getattr(self, k) for k in ENV}

    @property
    def fields(self) -> dict[str, str | bool]:
        """What a record says of the path that ran (the selftest's and capacity's records)."""
        return {"kv_layout": self.layout, "attention": self.attention, "decoder": self.decoder,
                "epilogues": self.epilogues, "overlap": self.overlap == "1"}  # fmt: skip

    def with_overlap(self) -> EnginePath:
        return EnginePath(self.layout, self.attention, self.decoder, self.epilogues, "1")


def parse_paths(spec: str, order: tuple[str, ...], required: int) -> list[EnginePath]:
    """Comma-separated paths, each `:`-separated in `order`; ValueError if one is malformed."""
    out = []
    for item in (s for s in spec.split(",") if s):
        parts = item.split(":")
        if not required <= len(parts) <= len(order) or not all(parts):
            raise ValueError(f"{item!r}: give {':'.join(order[:required])}[:{':'.join(order[required:])}]")
        values = {**FAITHFUL, **dict(zip(order, parts))}
        if values["overlap"] not in ("0", "1"):
            raise ValueError(f"{item!r}: overlap is 0 or 1")
        out.append(EnginePath(**values))
    return out


def parse_phase_ends(spec: str) -> dict[str, float]:
    """`phase:fraction` pairs, fractions rising in PHASES' order, each in (0, 1]; missing phases: 1."""
    ends = {p: 1.0 for p in PHASES}
    for item in (s for s in spec.split(",") if s):
        name, _, value = item.partition(":")
        if name not in ends:
            raise ValueError(f"--phase-ends: unknown phase {name!r} (one of {', '.join(PHASES)})")
        ends[name] = float(value)
    values = [ends[p] for p in PHASES]
    if any(not 0 < v <= 1 for v in values) or values != sorted(values):
        raise ValueError(f"--phase-ends: fractions in (0, 1], rising in the order {', '.join(PHASES)}: {spec!r}")
    return ends


@contextmanager
def applied(path: EnginePath):
    """The environment set to `path` while the engine is built and run, as it was afterwards."""
    before = {k: os.environ.get(k) for k in path.env}
    os.environ.update(path.env)
    try:
        yield path
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
