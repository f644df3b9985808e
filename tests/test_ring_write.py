"""The audio ring's write (core/shared.py SharedSlots.write, core/client.py EngineClient._write,
issue 48's leaner packet path) against a sample-by-sample reference on random packets: every sample
lands at its position modulo the ring, across wrap-arounds, and what does not fit comes back."""

from __future__ import annotations

import numpy as np

from nemo_serve.core.client import EngineClient
from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots
from .helpers_ring import ring_model_info

RING = 1000


def _slots(tmp_path, positions_in_shared: bool = True) -> SharedSlots:
    return SharedSlots.create(SharedLayout(3, RING, positions_in_shared), FileLock(str(tmp_path / "lock")))


_info = ring_model_info


def test_writes_land_sample_by_sample_across_wraps(tmp_path):
    rng = np.random.default_rng(7)
    shared = _slots(tmp_path)
    try:
        expected = np.zeros(RING, np.float32)
        start = 0
        for _ in range(400):
            n = int(rng.integers(1, RING + 1))
            samples = rng.standard_normal(n).astype(np.float32)
            shared.write(1, start, samples)
            for j in range(n):  # the reference: one sample at a time
                expected[(start + j) % RING] = samples[j]
            start += n
            assert np.array_equal(shared.ring[1].view(np.int32), expected.view(np.int32)), start
        assert not shared.ring[0].any() and not shared.ring[2].any()  # the neighbours untouched
    finally:
        shared.close()


def test_the_client_writes_what_fits_and_keeps_the_rest_in_order(tmp_path):
    """A full ring takes the part that fits; the rest waits and goes in, in order, once the core
    has read (here: the read end stored as the core stores it)."""
    rng = np.random.default_rng(8)
    shared = _slots(tmp_path)
    client = EngineClient(_info(), shared, 0, str(tmp_path))  # not started: no core, no ZMQ
    try:
        h = client.open_stream(lambda r: None)
        sent = []
        for _ in range(60):
            packet = rng.standard_normal(int(rng.integers(1, 400))).astype(np.float32)
            sent.append(packet)
            client.push(h, packet)
            # the core reads everything written so far, then a retry of what waited
            got = shared.read(h.slot, h.read, h.written) if h.written > h.read else np.zeros(0, np.float32)
            stream = np.concatenate(sent)
            assert np.array_equal(got, stream[h.read : h.written])
            shared.read_end[h.slot] = h.written
            while h.pending:
                rest = client._write(h, *h.pending[0])
                h.pending.popleft()
                if rest is not None:
                    h.pending.appendleft((rest, 0.0))
                    shared.read_end[h.slot] = h.written
            h.read = int(shared.read_end[h.slot])
        assert h.written == sum(map(len, sent)) and not h.pending
    finally:
        shared.close()


def test_the_client_takes_float64_lists_and_columns_as_float32_samples(tmp_path):
    """Decoders hand float32 1-D arrays (written as they are); anything else is converted first."""
    shared = _slots(tmp_path)
    client = EngineClient(_info(), shared, 0, str(tmp_path))
    try:
        h = client.open_stream(lambda r: None)
        x = np.random.default_rng(9).standard_normal(30)
        client.push(h, x[:10])  # float64
        client.push(h, x[10:20].reshape(-1, 1))  # a column
        client.push(h, x[20:].tolist())  # a list
        assert np.array_equal(shared.read(h.slot, 0, 30), x.astype(np.float32))
    finally:
        shared.close()
