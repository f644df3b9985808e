"""Diarized /ws streams under hostile and careless clients, through the real server (issue 50).

One `nemo-serve --diarizer builtin:tiny-sortformer` process, 3 slots, with NEMO_SERVE_CHECK_INVARIANTS
on: the engine core checks its books, the diarizer's slots and the results waiting for speakers
included (engine/loop.py Engine.check_accounting), after every iteration, and a drift fails the
core (so every later stream here would fail). Diarized sessions end every way a client can end
one: aborted mid-stream (a close frame), dropped right after speaking (RST, FIN), closed while a
final waits for the diarizer (after `end`, after `force_final`), or opened and dropped at once,
many times, beside a plain /ws neighbour whose tokens must equal its tokens on the quiet server.
After: every slot back, and three diarized streams at once (all the slots, so all the diarizer's)
run to `done` with speakers on their finals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import numpy as np
import pytest

from . import helpers
from .helpers_server import TOKEN, start_server

NUM_SLOTS = 3
RATE = 16000
CONFIG = json.dumps({"type": "config", "diarization": {"max_speakers": 2}})
END, FORCE = json.dumps({"type": "end"}), json.dumps({"type": "force_final"})
WAYS = ["close", "rst", "fin", "end_then_close", "force_final_then_close", "open_and_drop"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    books = tmp_path_factory.mktemp("books")
    env = {"NEMO_SERVE_PING_INTERVAL_S": "0", "NEMO_SERVE_CHECK_INVARIANTS": str(books)}
    with start_server("--num-slots", str(NUM_SLOTS), "--diarizer", "builtin:tiny-sortformer", env=env) as s:
        yield s
    assert list(books.glob("core-*.tsv")), "the engine core did not check its books"
    log = s.log()
    assert "Traceback" not in log and "AccountingError" not in log, log[-4000:]


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return np.concatenate(helpers.utterances(3, seed=11))


def _connect(server):
    from websockets.asyncio.client import connect

    return connect(server.ws_url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, proxy=None,
                   compression=None, max_size=None, ping_interval=None)  # fmt: skip


def _packets(pcm: np.ndarray) -> list[bytes]:
    return [pcm[i : i + RATE // 10].astype("<f4").tobytes() for i in range(0, len(pcm), RATE // 10)]


async def _session(server, pcm: np.ndarray, config: str | None = None, connected=None) -> list[dict]:
    """A whole /ws session at full speed: every message until the server closes. `connected`: an
    asyncio.Event set once the handshake is through (the slot is held from then on)."""
    async with _connect(server) as ws:
        if connected is not None:
            connected.set()
        for frame in ([config] if config else []) + _packets(pcm) + [END]:
            await ws.send(frame)
        return [json.loads(m) async for m in ws]


def _tokens(messages: list[dict]) -> list[int]:
    assert messages and messages[-1]["type"] == "done", messages[-3:]
    return [t for m in messages if m["type"] == "final" for t in m["token_ids"]]


async def _hostile_once(server, speech: np.ndarray, how: str, rng: np.random.Generator) -> None:
    """A diarized session that speaks for a while (results flowing) and is then ended by `how`;
    tried again while the server says no slot is free (a 503 or a 1013 close, as it promises while
    the slot of a session just dropped is not yet released)."""
    from websockets.exceptions import ConnectionClosedError

    for _ in range(100):
        try:
            return await _hostile_session(server, speech, how, rng)
        except ConnectionClosedError as e:
            assert e.rcvd is not None and e.rcvd.code == 1013, e
            await asyncio.sleep(0.05)
    raise AssertionError("no slot came back in 5 s")


async def _hostile_session(server, speech: np.ndarray, how: str, rng: np.random.Generator) -> None:
    async with _connect_when_free(server) as ws:
        await ws.send(CONFIG)
        if how != "open_and_drop":
            start = int(rng.integers(0, len(speech) - 3 * RATE))
            for frame in _packets(speech[start : start + int(rng.integers(5, 30)) * RATE // 10]):
                await ws.send(frame)
            await asyncio.sleep(float(rng.uniform(0, 0.3)))
        if how == "end_then_close":
            await ws.send(END)  # its last final waits for the diarizer to reach the end
        elif how == "force_final_then_close":
            await ws.send(FORCE)
        transport = ws.transport
        if how == "rst":
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            transport.abort()
        elif how in ("fin", "open_and_drop"):
            transport.close()  # no close frame
        else:
            with contextlib.suppress(Exception):
                await ws.close()


@contextlib.asynccontextmanager
async def _connect_when_free(server):
    """A connection, retried while every slot is taken: a dropped session's slot comes back only
    once the engine has released it, between steps (a 503 until then is the server's promise)."""
    from websockets.exceptions import InvalidStatus

    for _ in range(100):
        try:
            ws = await _connect(server)
            break
        except InvalidStatus as e:
            assert e.response.status_code == 503, e
            await asyncio.sleep(0.05)
    else:
        raise AssertionError("no slot came back in 5 s")
    async with ws:
        yield ws


def test_diarized_churn_leaks_nothing_and_leaves_a_plain_neighbour_exact(server, speech):
    neighbour = speech[: 6 * RATE]
    quiet = _tokens(asyncio.run(_session(server, neighbour)))
    assert quiet
    server.wait_open_streams(0)
    rng = np.random.default_rng(50)

    async def churn() -> None:
        for i in range(0, 36, 2):  # two hostile diarized sessions at a time: the third slot is the neighbour's
            await asyncio.gather(*[_hostile_once(server, speech, WAYS[(i + k) % len(WAYS)], rng) for k in range(2)])

    async def both() -> list[dict]:
        connected = asyncio.Event()
        plain = asyncio.create_task(_session(server, neighbour, connected=connected))
        await connected.wait()  # its slot first: the churn then has the other two
        await churn()
        return await plain

    assert _tokens(asyncio.run(both())) == quiet
    server.assert_no_leak()

    async def all_slots_diarized() -> list[list[dict]]:
        return await asyncio.gather(*[_session(server, speech[k * RATE : k * RATE + 5 * RATE], CONFIG) for k in range(NUM_SLOTS)])

    for messages in asyncio.run(all_slots_diarized()):  # a leaked diarizer slot would refuse one of them
        finals = [m for m in messages if m["type"] == "final"]
        assert _tokens(messages) and all(len(m["speakers"]) == len(m["token_ids"]) for m in finals)
    server.assert_no_leak()
