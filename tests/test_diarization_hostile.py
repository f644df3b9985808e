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


async def _session(server, pcm: np.ndarray, config: str | None = None) -> list[dict]:
    """A whole /ws session at full speed: every message until the server closes."""
    async with _connect(server) as ws:
        for frame in ([config] if config else []) + _packets(pcm) + [END]:
            await ws.send(frame)
        return [json.loads(m) async for m in ws]


def _tokens(messages: list[dict]) -> list[int]:
    assert messages and messages[-1]["type"] == "done", messages[-3:]
    return [t for m in messages if m["type"] == "final" for t in m["token_ids"]]


async def _hostile_once(server, speech: np.ndarray, how: str, rng: np.random.Generator) -> None:
    """A diarized session that speaks for a while (results flowing) and is then ended by `how`."""
    async with _connect(server) as ws:
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


def test_diarized_churn_leaks_nothing_and_leaves_a_plain_neighbour_exact(server, speech):
    neighbour = speech[: 6 * RATE]
    quiet = _tokens(asyncio.run(_session(server, neighbour)))
    assert quiet
    rng = np.random.default_rng(50)

    async def churn() -> None:
        for i in range(0, 36, 2):  # two hostile diarized sessions at a time: the third slot is the neighbour's
            await asyncio.gather(*[_hostile_once(server, speech, WAYS[(i + k) % len(WAYS)], rng) for k in range(2)])

    async def both() -> list[dict]:
        task = asyncio.create_task(churn())
        messages = await _session(server, neighbour)
        await task
        return messages

    assert _tokens(asyncio.run(both())) == quiet
    server.assert_no_leak()

    async def all_slots_diarized() -> list[list[dict]]:
        return await asyncio.gather(*[_session(server, speech[k * RATE : k * RATE + 5 * RATE], CONFIG) for k in range(NUM_SLOTS)])

    for messages in asyncio.run(all_slots_diarized()):  # a leaked diarizer slot would refuse one of them
        finals = [m for m in messages if m["type"] == "final"]
        assert _tokens(messages) and all(len(m["speakers"]) == len(m["token_ids"]) for m in finals)
    server.assert_no_leak()
