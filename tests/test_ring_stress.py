"""The shared-memory audio rings across processes (core/shared.py: positions published by message,
or stored in shared memory with the core's wake-up).

An engine core process whose Engine checks every sample against its stream's sequence number, and
a front end (the real EngineClient) that streams sequence-numbered packets of random sizes into
rings smaller than the largest packet, so that every ring wraps hundreds of times, fills, and is
reused by later streams (benchmarks/ring_stress.py). On x86-64 stores are seen in order anyway, so
there this checks the protocol (wrap, full ring, reuse, read ends); on aarch64 it checks the
ordering too. A front end that reuses ring space before the core has read it fails it (every
stream, at its first sample: tried by hand)."""

from __future__ import annotations

import platform

import pytest

from benchmarks.ring_stress import stress


@pytest.mark.parametrize("positions_in_shared", [False, True], ids=["messages", "shared"])
def test_every_sample_crosses_the_rings_in_order(positions_in_shared):
    ring, slots, streams = 997, 6, 24
    r = stress(num_slots=slots, num_streams=streams, ring_samples=ring, max_packet=1500,
               samples_per_stream=(20_000, 60_000), seed=1, positions_in_shared=positions_in_shared)  # fmt: skip
    where = f"on {platform.machine()}: {r}"
    assert r["bad"] == [] and r["streams"] == streams, where
    assert r["samples"] >= streams * 20_000 and r["samples"] > 100 * ring * slots, where  # laps, not one pass
    assert r["packets"] > 1000, where
