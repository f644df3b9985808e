"""Several engine cores behind the same front ends (--devices): two cores on the CPU stand for two GPUs.

Streams spread over the cores (each new one to the core with the most free slots), every stream's
tokens equal NeMo's loop, and a core killed mid-run costs only its own streams: the other core's
streams keep every token, /readyz stays ready with the dead core marked, new streams go to the
survivor, and the server exits 1 only when no core is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from . import helpers
from .helpers_server import TEST_MODEL, encode, start_server
from .helpers_e2e import check_well_formed, oracle_tokens, stream

SLOTS_PER_CORE = 2


@pytest.fixture(scope="module")
def oracle_model():
    return helpers.model(TEST_MODEL, None)


def _open_per_core(srv) -> list[int]:
    return [c["open_streams"] for c in srv.readyz()["cores"]]


def test_two_cores_spread_streams_and_a_dead_core_costs_only_its_own(oracle_model):
    utts = helpers.utterances(4, seed=13)
    wires = [encode(u, "pcm_f32le") for u in utts]
    with start_server("--devices", "cpu,cpu", "--frontends", "1", "--num-slots", str(SLOTS_PER_CORE),
                      "--idle-timeout-s", "20") as srv:  # fmt: skip
        r = srv.readyz()
        assert [(c["core"], c["device"], c["total_slots"], c["serving"]) for c in r["cores"]] == [
            (0, "cpu", SLOTS_PER_CORE, True), (1, "cpu", SLOTS_PER_CORE, True)]  # fmt: skip
        assert r["total_slots"] == r["free_slots"] == 2 * SLOTS_PER_CORE
        assert "engine cores pid" in srv.log()

        async def spread():
            tasks = []
            for w in wires:  # one at a time: each goes to the core with the most free slots
                tasks.append(asyncio.create_task(stream(srv.ws_url, w, 16000, "pcm_f32le", speed=1.0, packet=1600)))
                deadline = time.monotonic() + 20
                while srv.readyz()["open_streams"] < len(tasks):
                    assert time.monotonic() < deadline, srv.log()[-3000:]
                    await asyncio.sleep(0.05)
            counts = _open_per_core(srv)
            full = srv.get("/readyz")
            return await asyncio.gather(*tasks), counts, full.status_code

        transcripts, counts, full_status = asyncio.run(spread())
        assert counts == [SLOTS_PER_CORE, SLOTS_PER_CORE]  # spread over both cores
        assert full_status == 503  # every slot of both cores held: not ready
        for t, w in zip(transcripts, wires):
            check_well_formed(t)
            assert t.token_ids == oracle_tokens(oracle_model, w, 16000)
        srv.assert_no_leak()

        # One stream per core, then core 0 dies: its stream gets an error, core 1's keeps every token.
        # The live streams from here on need no whole utterance: 2 s keeps one open past the kill
        # and past the refusal read (CI paid a real-time second or two a stream for nothing). The
        # stream on the core that dies, opened first, keeps its whole utterance: it must still be
        # open when the kill comes, on a loaded machine too.
        short = [w[:32000] for w in wires]

        async def kill_one():
            tasks = []
            for w in (wires[0], short[1]):
                tasks.append(asyncio.create_task(stream(srv.ws_url, w, 16000, "pcm_f32le", speed=1.0, packet=1600)))
                while srv.readyz()["open_streams"] < len(tasks):
                    await asyncio.sleep(0.05)
            assert _open_per_core(srv) == [1, 1]
            await asyncio.sleep(0.5)
            os.kill(srv.readyz()["cores"][0]["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

        on_dead, on_live = asyncio.run(kill_one())
        assert on_dead.error is not None and "engine core 0 failed" in on_dead.error["reason"]
        assert on_dead.close_code == 1011
        check_well_formed(on_live)
        assert on_live.token_ids == oracle_tokens(oracle_model, short[1], 16000)
        r = srv.readyz()
        assert r["ready"] and [c["serving"] for c in r["cores"]] == [False, True]
        assert r["total_slots"] == r["free_slots"] == SLOTS_PER_CORE  # the survivor's
        assert srv.get("/healthz").status_code == 200
        assert 'nemo_serve_core_serving{core="0",device="cpu"} 0.0' in srv.metrics()

        # New streams go to the survivor; a third is refused at once (its two slots are held).
        async def after():
            tasks = [asyncio.create_task(stream(srv.ws_url, w, 16000, "pcm_f32le", speed=1.0, packet=1600))
                     for w in short[2:]]  # fmt: skip
            while srv.readyz()["open_streams"] < 2:
                await asyncio.sleep(0.05)
            refused = srv.get("/readyz").status_code
            return await asyncio.gather(*tasks), refused

        transcripts, refused = asyncio.run(after())
        assert refused == 503
        for t, w in zip(transcripts, short[2:]):
            check_well_formed(t)
            assert t.token_ids == oracle_tokens(oracle_model, w, 16000)
        srv.assert_no_leak()
        assert srv.proc.poll() is None  # one core left: the server serves on

        # The last core dies: now the server fails and exits 1 for its supervisor to restart it.
        os.kill(srv.readyz()["cores"][1]["pid"], signal.SIGKILL)
        assert srv.proc.wait(timeout=30) == 1
