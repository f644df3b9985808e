"""The multi-process server: one engine core process, front-end processes on one port.

Unit tests of the shared slot table and audio rings, then the real `nemo-serve --frontends 2`:
streams spread over both front ends keep NeMo's tokens, a full server refuses at the handshake
whichever front end answers, a front end killed mid-stream costs only its own streams (the
others keep every token, its slots come back, a new front end takes its place), and a killed
engine core gives every stream an error, /readyz 503 and a non-zero exit.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from nemo_serve.core.shared import FREE, FileLock, SharedLayout, SharedSlots
from nemo_serve.engine.errors import NoFreeSlotError

from . import helpers
from .helpers_server import TEST_MODEL, TOKEN, encode, start_server
from .helpers_e2e import check_well_formed, oracle_tokens, stream
from .helpers_processes import frontend_pids, streams_per_frontend

# ----------------------------------------------------------------------------- shared memory


@pytest.fixture
def shared(tmp_path):
    s = SharedSlots.create(SharedLayout(num_slots=3, ring_samples=10), FileLock(str(tmp_path / "lock")))
    yield s
    s.close()


def test_ring_keeps_order_across_the_wrap(shared):
    slot, _ = shared.allocate(frontend=0)
    got, start = [], 0
    for n in (4, 5, 3, 7, 1):  # 20 samples through a 10-sample ring: wraps twice
        shared.write(slot, start, np.arange(start, start + n, dtype=np.float32))
        got.append(shared.read(slot, start, start + n))
        start += n
    assert np.concatenate(got).tolist() == list(range(20))
    shared.write(slot, 20, np.arange(20, 30, dtype=np.float32))  # exactly full, from the middle of the ring
    assert shared.read(slot, 20, 30).tolist() == list(range(20, 30))
    assert [len(v) for v in shared.views(slot, 25, 35)] == [5, 5]  # across the end: two views, no copy


def test_audio_taken_in_is_copied_out_of_the_ring():
    """The core hands a stream's audio to the engine as views of its ring, then consumes that ring
    space: the front end may write the next samples over it at once, so the engine must have
    copied them when take_audio returns. (An engine that queued a view decoded overwritten audio
    and got other tokens: test_sherpa_compat's configless stream, on one clean-clone CI run.) The
    core admits a stream in the same iteration as, and before, its first audio (Open is a control
    message, step 1), so the audio always finds the stream open."""
    eng = helpers.bare_engine(helpers.model(TEST_MODEL), num_slots=1)
    audio = helpers.utterances(1, seed=8)[0][:24000]
    ring = audio.copy()
    s = eng.admit(slot=0, stream_id="s")
    eng.take_audio(s, (ring[:16000],), arrived=1.0)
    eng.take_audio(s, (ring[16000:20000], ring[20000:]), arrived=1.0)  # a wrapped ring: two parts
    ring[:] = -0.5  # the front end refills the consumed space
    eng.iterate()
    ring[:] = audio
    eng.take_audio(s, (ring[:8000],), arrived=2.0)
    ring[:] = -0.5
    got = np.zeros(32000, np.float32)
    s.audio.copy_segment(0, got)
    assert np.array_equal(got, np.concatenate([audio, audio[:8000]]))
    eng.abort(s)
    helpers.assert_engine_empty(eng)


def test_slot_table_allocates_frees_and_counts_generations(shared):
    a, gen_a = shared.allocate(frontend=1)
    b, _ = shared.allocate(frontend=2)
    c, _ = shared.allocate(frontend=1)
    assert sorted((a, b, c)) == [0, 1, 2] and shared.num_free == 0
    with pytest.raises(NoFreeSlotError):
        shared.allocate(frontend=2)
    shared.free([b])
    assert shared.num_free == 1 and shared.owner[b] == FREE
    shared.free([a])
    again, gen_again = shared.allocate(frontend=3)
    assert shared.owner[again] == 3
    if again == a:
        assert gen_again == gen_a + 1  # a late message for the slot's previous stream is told apart


def test_attached_view_sees_the_creators_writes(shared):
    other = SharedSlots.attach(shared.name, shared.layout, shared.lock)
    try:
        slot, _ = other.allocate(frontend=5)
        other.write(slot, 0, np.ones(3, dtype=np.float32))
        assert shared.owner[slot] == 5
        assert shared.read(slot, 0, 3).tolist() == [1.0, 1.0, 1.0]
    finally:
        other.close()


# ----------------------------------------------------------------------------- processes


def core_pid(srv) -> int:
    return int(re.search(r"engine core pid (\d+)", srv.log()).group(1))


@pytest.fixture(scope="module")
def oracle_model():
    return helpers.model(TEST_MODEL, None)


@pytest.fixture(scope="module")
def two_frontends():
    with start_server("--frontends", "2", "--num-slots", "6", "--idle-timeout-s", "20") as s:
        deadline = time.monotonic() + 60
        while len(frontend_pids(s)) < 2:  # /readyz answers as soon as the first one listens
            assert time.monotonic() < deadline, s.log()[-3000:]
            time.sleep(0.2)
        yield s


def test_streams_over_two_frontends_match_oracle(two_frontends, oracle_model):
    """Two waves of six streams: each front end serves some of them (seen from /proc: the stream
    sockets each front-end process holds while they play), and every stream keeps NeMo's tokens.
    The kernel hashes each connection to a front end, so all twelve land on one in 1 run of 2048."""
    srv = two_frontends
    utts = helpers.utterances(6, seed=5)
    pids = frontend_pids(srv)
    most_held = dict.fromkeys(pids, 0)  # pid -> most stream sockets it held at once

    async def watch(done: asyncio.Event):
        while not done.is_set():
            for pid, n in (await asyncio.to_thread(streams_per_frontend, srv)).items():
                most_held[pid] = max(most_held.get(pid, 0), n)
            await asyncio.sleep(0.05)

    async def wave():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        transcripts = await asyncio.gather(
            *(stream(srv.ws_url, encode(u, "pcm_s16le"), 16000, "pcm_s16le", speed=3.0, delay_s=0.1 * i)
              for i, u in enumerate(utts))
        )  # fmt: skip
        done.set()
        await watcher
        return transcripts

    for _ in range(2):
        transcripts = asyncio.run(wave())
        for i, (t, u) in enumerate(zip(transcripts, utts)):
            check_well_formed(t)
            assert t.token_ids == oracle_tokens(oracle_model, encode(u, "pcm_s16le"), 16000), f"stream {i}"
    assert sorted(most_held) == pids and all(n >= 1 for n in most_held.values()), most_held  # spread
    answered = {srv.readyz()["pid"] for _ in range(40)}  # fresh connections, spread by the kernel
    assert answered == set(pids) and len(answered) == 2
    srv.assert_no_leak()


def test_only_the_engine_core_loads_torch(two_frontends):
    """NeMo and torch load in the engine core alone: the supervisor and the front ends stay small,
    start without them and exit without their seconds of teardown."""

    def torch_mapped(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    srv = two_frontends
    assert torch_mapped(core_pid(srv))  # the check sees torch where it is
    assert [torch_mapped(pid) for pid in [srv.proc.pid, *frontend_pids(srv)]] == [False] * 3


def test_full_server_refuses_at_the_handshake_on_every_frontend(two_frontends):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    srv = two_frontends
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def scenario():
        held = []
        for _ in range(6):  # every slot, whichever front end each socket lands on
            ws = await connect(srv.ws_url, additional_headers=headers)
            await ws.send('{"type": "config"}')
            assert '"ready"' in await ws.recv()
            held.append(ws)
        refused = []
        for _ in range(6):
            try:
                ws = await connect(srv.ws_url, additional_headers=headers)
                refused.append(None)
                await ws.close()
            except InvalidStatus as e:
                refused.append(e.response.status_code)
        ready = httpx.get(srv.http_url + "/readyz", timeout=10)
        for ws in held:
            await ws.close()
        return refused, ready

    refused, ready = asyncio.run(scenario())
    assert refused == [503] * 6
    assert ready.status_code == 503 and ready.json()["free_slots"] == 0
    srv.assert_no_leak()


def test_frontend_killed_mid_stream_costs_only_its_own_streams(two_frontends, oracle_model):
    srv = two_frontends
    utts = helpers.utterances(6, seed=9)
    wires = [encode(u, "pcm_s16le") for u in utts]
    killed: dict = {}

    async def scenario():
        tasks = [asyncio.create_task(stream(srv.ws_url, w, 16000, "pcm_s16le", speed=1.0, packet=1600))
                 for w in wires]  # fmt: skip
        deadline = time.monotonic() + 30
        while srv.readyz()["open_streams"] < 6:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        counts = streams_per_frontend(srv)
        if min(counts.values()) == 0:
            # The kernel's SO_REUSEPORT hash put every connection on one front end (about 3% of
            # runs with six): nothing would be left to check. Let these streams end; try again.
            await asyncio.gather(*tasks)
            return None
        victim = min(counts, key=lambda p: counts[p])  # the front end with the fewest streams
        killed.update(pid=victim, streams=counts[victim], counts=counts)
        os.kill(victim, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    for _ in range(4):
        transcripts = asyncio.run(scenario())
        if transcripts is not None:
            break
        srv.assert_no_leak()
    assert transcripts is not None, "every connection went to one front end four times in a row"
    cut = [t for t in transcripts if t.done is None]
    kept = [(t, w) for t, w in zip(transcripts, wires) if t.done is not None]
    assert len(cut) == killed["streams"], (killed, [t.close_code for t in transcripts])
    assert all(t.close_code == 1006 for t in cut)  # the connection dropped with its process
    assert kept, killed
    for t, w in kept:  # the other front end's streams: every token
        check_well_formed(t)
        assert t.token_ids == oracle_tokens(oracle_model, w, 16000)
    srv.assert_no_leak()  # the dead front end's slots came back
    deadline = time.monotonic() + 60
    while len(frontend_pids(srv)) < 2:  # and a new front end took its place
        assert time.monotonic() < deadline, srv.log()[-3000:]
        time.sleep(0.2)
    assert killed["pid"] not in frontend_pids(srv)
    t = asyncio.run(stream(srv.ws_url, wires[0], 16000, "pcm_s16le"))
    assert t.token_ids == oracle_tokens(oracle_model, wires[0], 16000)
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


def test_dead_engine_core_fails_streams_and_exits_nonzero():
    utts = helpers.utterances(2, seed=3)
    with start_server("--frontends", "2", "--num-slots", "2") as srv:

        async def scenario():
            tasks = [asyncio.create_task(stream(srv.ws_url, encode(u, "pcm_f32le"), 16000, "pcm_f32le", speed=1.0))
                     for u in utts]  # fmt: skip
            while srv.readyz()["open_streams"] < 2:
                await asyncio.sleep(0.05)
            os.kill(core_pid(srv), signal.SIGKILL)
            transcripts = await asyncio.gather(*tasks)
            return transcripts, srv.get("/readyz").status_code, srv.get("/healthz").status_code

        transcripts, ready_status, health_status = asyncio.run(scenario())
        code = srv.proc.wait(timeout=30)
    for t in transcripts:
        assert t.error is not None and "engine" in t.error["reason"], t.messages[-2:]
        assert t.close_code == 1011
    assert ready_status == 503 and health_status == 503
    assert code == 1
