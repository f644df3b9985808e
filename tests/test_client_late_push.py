"""A front end's late audio for a stream the core already released (core/client.py).

The core frees a released stream's slot before its front end hears `done` (one delivery order:
core/engine_core.py). In that gap the front end may still push audio for the stream (its session
has not seen the end yet; a stream whose open the core refused never sent a Finish at all), and
the slot may meanwhile hold the next stream. That audio must not land in the next stream's ring.
Here: the real EngineClient on asyncio and the real EngineCoreProc on the same thread, one slot,
stream A ended and released, stream B opened on the same slot and pushed, then A's late packet;
B's ring must hold B's audio and B's tokens must equal a solo run of the same audio."""

from __future__ import annotations

import asyncio
import tempfile

import numpy as np
import pytest
import zmq

from nemo_serve.core.client import EngineClient
from nemo_serve.core.core_proc import EngineCoreProc
from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots
from nemo_serve.engine.endpoint import EndpointConfig

from . import helpers
from .helpers_server import TEST_MODEL

RING = 16000 * 2  # A writes exactly one ring's worth, so its next sample would go to position 0


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


def _solo_tokens(model, audio) -> list[int]:
    out = helpers.drive(helpers.new_engine(model, num_slots=1, endpoint=EndpointConfig()), [audio])
    return out.tokens(0)


async def _late_push_run(model, audio_a, audio_b, late, positions_in_shared) -> tuple[list[int], np.ndarray]:
    """B's tokens, and what B's ring held when the core read it."""
    ipc_dir = tempfile.mkdtemp(prefix="ns-late-")
    shared = SharedSlots.create(SharedLayout(1, RING, positions_in_shared), FileLock(f"{ipc_dir}/lock"))
    ctx = zmq.Context()
    proc = EngineCoreProc(helpers.bare_engine(model, 1, EndpointConfig()), shared, ipc_dir, ctx)
    client = EngineClient(proc.engine.model_info, shared, 0, ipc_dir).start()
    got_a, got_b = [], []

    def step_until(pred, max_iters=400) -> None:
        for _ in range(max_iters):
            proc.control.poll(5)
            proc.iterate_once()
            if pred():
                return
        raise AssertionError("the core did not get there")

    try:
        a = client.open_stream(got_a.append, stream_id="A")
        client.push(a, audio_a)  # the whole ring
        await asyncio.sleep(0.01)  # the Wrote goes out
        step_until(lambda: proc.core._read_end[0] == RING)
        for _ in range(50):  # the front end learns the ring space is free again
            await asyncio.sleep(0.01)
            if _read_end(client, a) == RING:
                break
        assert _read_end(client, a) == RING
        client.finish(a)
        # No await from here: the front end does not see A's `done` while the core releases A.
        step_until(lambda: shared.num_free == 1)
        b = client.open_stream(got_b.append, stream_id="B")
        assert b.slot == a.slot and not a.ended  # the slot is reused; A still looks open here
        client.push(b, audio_b)
        client.push(a, late)  # A's late packet: the session has not seen A end
        ring_b = shared.read(b.slot, 0, len(audio_b))
        client.finish(b)
        await asyncio.sleep(0.01)
        for _ in range(2000):
            proc.control.poll(5)
            proc.iterate_once()
            await asyncio.sleep(0)
            if got_b and got_b[-1].done:
                break
        assert got_b and got_b[-1].done and got_a and got_a[-1].done
        return [t for r in got_b for t in r.new_token_ids], ring_b
    finally:
        client.stop()
        proc.close()
        ctx.term()
        shared.close()


def _read_end(client, h) -> int:
    """How far the front end knows the core has read (from Results, or from shared memory)."""
    return client._shared_read_end(h) if client._positions_in_shared else h.read


@pytest.mark.parametrize("positions_in_shared", [False, True], ids=["messages", "shared"])
def test_a_released_streams_late_audio_does_not_reach_the_next_stream_on_its_slot(tiny, positions_in_shared):
    a_audio, b_audio = helpers.utterances(2, seed=3)
    a_audio = np.resize(a_audio, RING).astype(np.float32)
    b_audio = b_audio[: 16000 * 3 // 2].astype(np.float32)
    late = np.random.default_rng(0).standard_normal(8000).astype(np.float32)
    tokens_b, ring_b = asyncio.run(_late_push_run(tiny, a_audio, b_audio, late, positions_in_shared))
    np.testing.assert_array_equal(ring_b, b_audio)  # before the fix: A's noise in samples 0..7999
    assert tokens_b == _solo_tokens(tiny, b_audio) and tokens_b
