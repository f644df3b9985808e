"""Diarized /ws streams under hostile and careless clients, through the real server (issue 50).

One `nemo-serve --diarizer ...` process per configuration, 3 slots, with NEMO_SERVE_CHECK_INVARIANTS
on: the engine core checks its books, the diarizer's slots and the results waiting for speakers
included (engine/loop.py Engine.check_accounting), after every iteration, and a drift fails the
core (so every later stream here would fail). The configurations: builtin:tiny-sortformer (128
mels: the diarizer computes its own features) and builtin:demo-sortformer (80 mels, the test ASR
model's preprocessor: its frames come from the ASR step, diarization/shared_features.py), the
latter with the overlapped loop off and on (NEMO_SERVE_OVERLAP). Sessions, diarized and plain on
the same slots, end every way a client can end one: aborted mid-stream (a close frame), dropped
right after speaking (RST, FIN), closed while a final waits for the diarizer (after `end`, after
`force_final`), opened and dropped at once, or ended and read to `done` (input lengths in samples;
four end 4 frames past a chunk, a tail the ASR model does not encode, so the core releases the
stream on it: on the shared path the diarizer then computes the frames it was waiting for), many
times, beside a plain /ws neighbour whose tokens must equal its tokens on the quiet server. After:
every slot back, and three diarized streams at once (all the slots, so all the diarizer's) run to
`done`, each token with the speaker it got when its stream ran alone before the churn.

A drop needs an open socket: where the server has closed it first (a 1013 "no slot" close that
came in while the client slept: the session is tried again) the client does not touch it, and
any other close it meets first is counted and fails the test (tests/test_diarization_hostile.py
once failed here with Errno 9, setting SO_LINGER on a socket already closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import Counter

import numpy as np
import pytest

from nemo_serve.builtin.sortformer import DEMO_DIARIZER_PATH

from . import helpers
from .helpers_server import TOKEN, start_server

NUM_SLOTS = 3
RATE = 16000
CONFIG = json.dumps({"type": "config", "diarization": {"max_speakers": 2}})
END, FORCE = json.dumps({"type": "end"}), json.dumps({"type": "force_final"})
DROPS = ["rst", "fin", "open_and_drop"]  # the client drops the TCP connection itself
WAYS = ["close", "rst", "fin", "end_then_close", "force_final_then_close", "open_and_drop", "end_and_read",
        "force_final_and_read"]  # fmt: skip
SESSION_TIMEOUT_S = 60.0  # a session read to `done`: its speakers must come (a stall fails, it does not hang)
# name -> (--diarizer, NEMO_SERVE_OVERLAP, whether its frames come from the ASR step). Two servers, to
# keep CI under its 30 minutes: each feature path once, the shared one with the overlapped loop (the
# shared path with overlap off is run through every way a stream stops in
# tests/test_diarization_shared_features.py).
SERVERS = {
    "own-features": ("builtin:tiny-sortformer", "0", False),
    "shared-overlap": ("builtin:demo-sortformer", "1", True),
}


class ServerClosedFirst(Exception):
    """The server closed the connection before the client dropped it (`code`: its close code)."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"the server closed first ({code})")
        self.code = code


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tmp_path_factory):
    diarizer, overlap, shared = SERVERS[request.param]
    if diarizer == "builtin:demo-sortformer" and not DEMO_DIARIZER_PATH.exists():
        pytest.skip("no demo_sortformer.nemo shipped")
    books = tmp_path_factory.mktemp("books")
    env = {"NEMO_SERVE_PING_INTERVAL_S": "0", "NEMO_SERVE_CHECK_INVARIANTS": str(books), "NEMO_SERVE_OVERLAP": overlap}
    args = ["--num-slots", str(NUM_SLOTS), "--diarizer", diarizer, "--log-level", "info"]
    with start_server(*args, env=env) as s:
        features = "diarizer features: the ASR model's" if shared else "diarizer features: its own"
        assert features in s.log(), "not the feature path this server is for"
        yield s
    assert list(books.glob("core-*.tsv")), "the engine core did not check its books"
    log = s.log()
    assert "Traceback" not in log and "AccountingError" not in log, log[-4000:]
    assert "speaker of forgotten frame" not in log, log[-4000:]  # a token's speaker guessed (diarization/runner.py)


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


def _assert_speakers(messages: list[dict]) -> None:
    """Every final of a diarized session to `done` has a speaker for each token."""
    finals = [m for m in messages if m["type"] == "final"]
    assert messages[-1]["type"] == "done" and finals, messages[-3:]
    assert all(len(m["speakers"]) == len(m["token_ids"]) for m in finals), finals


async def _hostile_once(server, speech: np.ndarray, how: str, diarized: bool, rng: np.random.Generator,
                        outcomes: Counter, length: int | None = None) -> None:  # fmt: skip
    """A session that speaks for a while (results flowing) and is then ended by `how`; tried again
    while the server says no slot is free (a 503 or a 1013 close, as it promises while the slot of
    a session just dropped is not yet released). `outcomes[how, ...]`: what happened. `length`:
    its input's samples (default: random)."""
    from websockets.exceptions import ConnectionClosedError

    for _ in range(200):
        try:
            outcomes[how, await _hostile_session(server, speech, how, diarized, rng, length)] += 1
            return
        except ConnectionClosedError as e:
            assert e.rcvd is not None and e.rcvd.code == 1013, e
        except ServerClosedFirst as e:
            if e.code != 1013:
                outcomes[how, f"server closed first ({e.code})"] += 1
                return
        outcomes[how, "no slot (1013), tried again"] += 1
        await asyncio.sleep(0.05)
    raise AssertionError("no slot came back in 10 s")


async def _hostile_session(server, speech: np.ndarray, how: str, diarized: bool, rng: np.random.Generator,
                           length: int | None) -> str:  # fmt: skip
    async with _connect_when_free(server) as ws:
        if diarized:
            await ws.send(CONFIG)
        if how != "open_and_drop":
            start = int(rng.integers(0, len(speech) - 3 * RATE))
            # Lengths in samples, not packets: some inputs end on a tail the ASR model does not encode.
            for frame in _packets(speech[start : start + (length or int(rng.integers(RATE // 2, 3 * RATE)))]):
                await ws.send(frame)
            await asyncio.sleep(float(rng.uniform(0, 0.3)))
        if how in ("end_then_close", "end_and_read"):
            await ws.send(END)  # its last final waits for the diarizer to reach the end
        elif how in ("force_final_then_close", "force_final_and_read"):
            await ws.send(FORCE)
        if how.endswith("_and_read"):
            read = await asyncio.wait_for(_read_to_done(ws, how, diarized), SESSION_TIMEOUT_S)
            return read + (" (a tail not encoded)" if length else "")
        if how in DROPS:
            _drop(ws, rst=how == "rst")
            return "dropped"
        with contextlib.suppress(Exception):
            await ws.close()
        return "closed"


def _tail_length(server, chunks: int) -> int:
    """Samples of an input that ends 4 frames past its first chunk and `chunks` later ones: a tail
    shorter than the 8 frames NeMo's loop encodes, so the core releases the stream on it without
    an ASR step (engine/scheduler.py), and on the shared path the diarizer computes the frames it
    was waiting for. Chunks of 8(R+1) 10 ms frames, the first 1 + 8R (docs/how_it_works.md)."""
    chunk = round(server.readyz()["chunk_ms"] / 10)
    frames = chunk - 7 + chunks * chunk + 4  # NeMo's frames at the end of input: samples // hop + 1
    return (frames - 1) * RATE // 100 + 50


def _drop(ws, rst: bool) -> None:
    """Drop the TCP connection without a close frame: RST (SO_LINGER 0) or FIN. Checked and done in
    one synchronous stretch: only this event loop closes the socket, so it cannot close in between."""
    transport = ws.transport
    sock = transport.get_extra_info("socket")
    if ws.close_code is not None or transport.is_closing() or sock is None or sock.fileno() == -1:
        raise ServerClosedFirst(ws.close_code)
    if rst:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        transport.abort()
    else:
        transport.close()


async def _read_to_done(ws, how: str, diarized: bool) -> str:
    """Every message to `done`, `end` sent after a forced final arrives; speakers checked."""
    messages = []
    async for raw in ws:
        messages.append(json.loads(raw))
        if how == "force_final_and_read" and messages[-1]["type"] == "final" and messages[-1].get("end_reason") == "force_final":
            await ws.send(END)
    if diarized:
        _assert_speakers(messages)
    else:
        assert messages[-1]["type"] == "done" and all("speakers" not in m for m in messages), messages[-3:]
    return "read to done"


@contextlib.asynccontextmanager
async def _connect_when_free(server):
    """A connection, retried while every slot is taken: a dropped session's slot comes back only
    once the engine has released it, between steps (a 503 until then is the server's promise)."""
    from websockets.exceptions import InvalidStatus

    for _ in range(200):
        try:
            ws = await _connect(server)
            break
        except InvalidStatus as e:
            assert e.response.status_code == 503, e
            await asyncio.sleep(0.05)
    else:
        raise AssertionError("no slot came back in 10 s")
    async with ws:
        yield ws


def _speakers(messages: list[dict]) -> list[tuple]:
    """Each final's tokens and their speakers, as a client sees them."""
    return [(m["token_ids"], m["speakers"], m["speaker"]) for m in messages if m["type"] == "final"]


def test_diarized_churn_leaks_nothing_and_leaves_a_plain_neighbour_exact(server, speech):
    neighbour = speech[: 6 * RATE]
    quiet = _tokens(asyncio.run(_session(server, neighbour)))
    assert quiet
    diarized = [speech[k * RATE : k * RATE + 5 * RATE] for k in range(NUM_SLOTS)]
    quiet_speakers = [_speakers(asyncio.run(_session(server, pcm, CONFIG))) for pcm in diarized]
    server.wait_open_streams(0)
    rng = np.random.default_rng(50)
    outcomes: Counter = Counter()
    tails = [_tail_length(server, chunks) for chunks in (0, 1)]

    async def churn() -> None:
        for i in range(0, 2 * len(WAYS) * 2, 2):  # two hostile sessions at a time: the third slot is the neighbour's
            ways = [WAYS[(i + k) % len(WAYS)] for k in range(2)]
            # Diarized and plain sessions take the same slots in turn (every third a plain one).
            # Every other pair of read-to-done inputs (i = 6, 22) ends on a tail the ASR model does not encode.
            lengths = [tails[i // 16 % 2] if how.endswith("_and_read") and i % 16 == 6 else None for how in ways]
            await asyncio.gather(*[_hostile_once(server, speech, how, (i // 2 + k) % 3 != 2, rng, outcomes, length)
                                   for k, (how, length) in enumerate(zip(ways, lengths))])  # fmt: skip

    async def both() -> list[dict]:
        connected = asyncio.Event()
        plain = asyncio.create_task(_session(server, neighbour, connected=connected))
        await connected.wait()  # its slot first: the churn then has the other two
        await churn()
        return await plain

    assert _tokens(asyncio.run(both())) == quiet
    print(dict(outcomes))
    assert not [k for k in outcomes if k[1].startswith("server closed first")], outcomes
    assert all(outcomes[how, "dropped"] for how in DROPS), outcomes  # each drop was done, not skipped
    assert all(outcomes[how, "read to done"] for how in WAYS if how.endswith("_and_read")), outcomes
    assert sum(n for (how, what), n in outcomes.items() if what.endswith("(a tail not encoded)")) == 4, outcomes
    server.assert_no_leak()

    async def all_slots_diarized() -> list[list[dict]]:
        return await asyncio.gather(*[_session(server, pcm, CONFIG) for pcm in diarized])

    for messages, alone in zip(asyncio.run(all_slots_diarized()), quiet_speakers):  # a leaked slot would refuse one
        assert _tokens(messages)
        _assert_speakers(messages)
        assert _speakers(messages) == alone  # batched after the churn: each token's speaker as when alone
    server.assert_no_leak()


def test_a_drop_the_server_closed_first_is_its_close_not_an_oserror(server):
    """The client's drop on a connection the server has closed (here: a bad message, 1008) is told
    apart, with the server's code, instead of an Errno 9 from setting SO_LINGER on a closed socket."""
    from websockets.exceptions import ConnectionClosed

    async def bad_message_then_drop() -> int | None:
        async with _connect(server) as ws:
            await ws.send(json.dumps({"type": "no such message"}))
            with contextlib.suppress(ConnectionClosed):
                async for _ in ws:  # the error message, then the server's close
                    pass
            with pytest.raises(ServerClosedFirst) as closed:
                _drop(ws, rst=True)
            return closed.value.code

    assert asyncio.run(bad_message_then_drop()) == 1008
    server.assert_no_leak()
