"""A positional forced final through the real transport (core/client.py EngineClient, the engine
core process's loop driven on this thread): the ForceFinal is sent before the audio past its
point, but with ring positions in shared memory the audio is visible to the core at once while
the message may still be in ZMQ's hands. The core steps here without taking its messages (what
a core that polled just before the message arrived does, many times over): it must not decode
past the point, so the segment still ends where a caught-up force_final ends it (shared.py's
`forced` count). Positions in messages are ordered with the ForceFinal by the one socket."""

from __future__ import annotations

import asyncio
import tempfile

import pytest
import zmq

from nemo_serve.core.client import EngineClient
from nemo_serve.core.core_proc import EngineCoreProc
from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots
from nemo_serve.engine.endpoint import EndpointConfig

from . import helpers
from .helpers_server import TEST_MODEL
from .test_forced_ends import _caught_up_reference, _segments


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


async def _forced_over_transport(model, audio, at: int, positions_in_shared: bool) -> list:
    ipc_dir = tempfile.mkdtemp(prefix="ns-forced-")
    shared = SharedSlots.create(SharedLayout(1, 16000 * 16, positions_in_shared), FileLock(f"{ipc_dir}/lock"))
    ctx = zmq.Context()
    proc = EngineCoreProc(helpers.bare_engine(model, 1, EndpointConfig.off()), shared, ipc_dir, ctx)
    client = EngineClient(proc.engine.model_info, shared, 0, ipc_dir).start()
    got = []
    try:
        h = client.open_stream(got.append, stream_id="A")
        for _ in range(400):  # the Open applied
            proc.control.poll(5)
            proc.iterate_once()
            if proc.engine.slots.held[h.slot]:
                break
        client.push(h, audio[:at])
        client.force_final(h, at_sample=at)
        client.push(h, audio[at:])
        client.finish(h)
        for _ in range(60):  # steps that do not take the ForceFinal (nor anything sent with it)
            proc.step()
        await asyncio.sleep(0.01)  # the Wrotes go out (positions in messages)
        for _ in range(4000):
            proc.control.poll(5)
            proc.iterate_once()
            await asyncio.sleep(0)
            if got and got[-1].done:
                break
        assert got and got[-1].done
        return _segments(got)
    finally:
        client.stop()
        proc.close()
        ctx.term()
        shared.close()


@pytest.mark.parametrize("positions_in_shared", [False, True], ids=["messages", "shared"])
def test_a_forced_final_in_transit_still_ends_the_segment_at_its_sample(tiny, positions_in_shared):
    audio = helpers.utterances(1, seed=3)[0]
    at = int(1.3 * tiny.geometry.sample_rate) + 37
    expected = _caught_up_reference(tiny, audio, [at])
    assert len(expected) == 2 and expected[0][0], expected
    assert asyncio.run(_forced_over_transport(tiny, audio, at, positions_in_shared)) == expected
