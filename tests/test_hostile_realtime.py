"""/v1/realtime under hostile and careless clients (issue 45), as tests/test_hardening.py holds /ws:
one regression test per defect, scripted bad inputs, a seeded fuzz, churn with every way a
connection ends, a /ws neighbour compared token for token, slots and memory checked after.

One real `nemo-serve` process for the module: 3 slots, pings off, a 2 s send timeout and a
debug-level log (the level at which client secrets used to be written), serving /v1/realtime on
both WebSocket listeners: uvicorn (--port) and picows (--fast-ws-port). The tests of what a
session does with its input run against both (`listener`), since each listener hands frames,
closes and back-pressure to the session its own way; a test that stays on one says why.
"""

from __future__ import annotations

import asyncio
import base64
import json
import contextlib
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from nemo_serve.client import StreamingClient
from nemo_serve.server.auth import mint_client_secret

from . import helpers
from .helpers_server import LISTENERS, TOKEN, start_server
from .helpers_ws import masked_frame, messages_until_close, raw_handshake, raw_upgrade

NUM_SLOTS = 3
ENV = {"NEMO_SERVE_PING_INTERVAL_S": "0", "NEMO_SERVE_SEND_TIMEOUT_S": "2"}
ARGS = ("--num-slots", str(NUM_SLOTS), "--idle-timeout-s", "20", "--log-level", "debug")
RATE = 16000


@pytest.fixture(scope="module")
def rt():
    with start_server(*ARGS, env=ENV, fast_ws=True) as s:
        yield s
    assert "Traceback" not in s.log(), s.log()[-4000:]


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """Two utterances, PCM16 at 16 kHz."""
    audio = np.concatenate(helpers.utterances(2, seed=3))
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")


def _connect(server, uri_suffix: str = "", listener: str = "uvicorn", **kw):
    from websockets.asyncio.client import connect

    kw.setdefault("additional_headers", {"Authorization": f"Bearer {TOKEN}"})
    url = f"{server.ws_base(listener)}/v1/realtime{uri_suffix}"
    return connect(url, proxy=None, compression=None, max_size=None, ping_interval=None, **kw)


def _update(**session) -> str:
    fmt = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}}}}
    return json.dumps({"type": "session.update", "session": {"type": "transcription", **fmt, **session}})


def _append(pcm: np.ndarray) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode()})


COMMIT = json.dumps({"type": "input_audio_buffer.commit"})


async def _ws_tokens(server, pcm: np.ndarray, opened: asyncio.Event | None = None, listener: str = "uvicorn") -> list[int]:
    """A /ws stream of `pcm` in 100 ms packets: its final tokens (`opened` set once it holds its slot)."""
    async with StreamingClient(server.ws_base(listener) + "/ws", sample_rate=RATE, encoding="pcm_s16le", token=TOKEN) as c:
        if opened is not None:
            opened.set()
        for i in range(0, len(pcm), RATE // 10):
            await c.send_audio(pcm[i : i + RATE // 10])
        await c.end()
        finals = [m async for m in c.messages() if m["type"] == "final"]
    return [t for f in finals for t in f["token_ids"]]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


# ----------------------------------------------------------------------------- defect 7: secrets in the log


def test_minted_client_secrets_never_reach_the_debug_log(rt):
    """Defect 7: at --log-level debug the handshake's `authorization` and `sec-websocket-protocol`
    header lines carried minted client secrets (the server token was redacted, they were not).
    Two secrets minted by the real POST, each used the way its client uses it: neither, nor its
    MAC, appears in the log. First in the module: the log keeps 20 lines of a kind, then 2 per
    second, and the header lines checked for must not be the ones rate-limited away. On --port
    only: the header lines are uvicorn's websockets protocol's; picows's logger goes through the
    same filter (logsafe.install, on the root handler), which redacts a secret by its shape."""
    import httpx

    def mint() -> str:
        r = httpx.post(rt.http_url + "/v1/realtime/transcription_sessions", json={}, headers=rt.auth_headers, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["client_secret"]["value"]

    bearer, offered = mint(), mint()

    async def use() -> None:
        for headers, protocols in (({"Authorization": f"Bearer {bearer}"}, None),
                                   ({}, ["realtime", f"realtime-token.{offered}"])):  # fmt: skip
            async with _connect(rt, additional_headers=headers, subprotocols=protocols) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"

    start = len(rt.log())
    asyncio.run(use())
    time.sleep(0.3)  # let the last lines land
    log = rt.log()[start:]
    assert "authorization:" in log.lower() and "sec-websocket-protocol:" in log.lower(), log[-2000:]  # the lines are there
    for secret in (bearer, offered):
        assert secret not in log and secret.rsplit("_", 1)[1] not in log, log[-3000:]


# ----------------------------------------------------------------------------- defect 1: slot leak


def _raw_realtime(server, listener: str) -> socket.socket:
    """A raw socket past the /v1/realtime upgrade (its 101 read, nothing after it)."""
    return raw_upgrade(server.ws_port(listener), "/v1/realtime")


@pytest.mark.parametrize("num_appends", [1, 10])
@pytest.mark.parametrize("one_write", [True, False], ids=["one-write", "update-first"])
@pytest.mark.parametrize("listener", LISTENERS)
def test_clean_close_right_after_appends_frees_the_slot(rt, speech, num_appends, one_write, listener):
    """Defect 1: default server VAD, session.update at 16 kHz, 100 ms appends, then close 1000 at
    once. The appends and the close arrive together: the send of session.updated fails, run()
    aborts its streams, and the receive task, cancelled as its frame arrived, still handled the
    append (asyncio.wait_for before 3.12 returns the frame instead of raising) and opened a
    stream nothing aborted. Five sessions each: every slot comes back."""
    frames = b"".join(masked_frame(_append(speech[i * 1600 : (i + 1) * 1600]).encode()) for i in range(num_appends))
    frames += masked_frame(struct.pack(">H", 1000), opcode=8)
    for _ in range(5):
        with _raw_realtime(rt, listener) as s:
            if one_write:
                s.sendall(masked_frame(_update().encode()) + frames)
            else:
                s.sendall(masked_frame(_update().encode()))
                time.sleep(0.05)
                s.sendall(frames)
            with contextlib.suppress(OSError):
                while s.recv(65536):  # until the server's close
                    pass
    rt.assert_no_leak(timeout_s=5)


# ----------------------------------------------------------------------------- defect 6: one session, every slot


@pytest.mark.parametrize("listener", LISTENERS)
def test_commit_burst_leaves_slots_for_a_neighbour(rt, speech, listener):
    """Defect 6: back-to-back (append 0.5 s, commit) took every slot (a /ws client got 503). A
    session holds at most its current item and the one it is finishing: the burst's items all
    complete, a /ws neighbour gets a slot and its tokens equal its tokens on a quiet server."""
    neighbour = speech[: 4 * RATE]
    quiet = asyncio.run(_ws_tokens(rt, neighbour, listener=listener))
    num_commits = 40
    half = RATE // 2

    async def burst(started: asyncio.Event) -> list[dict]:
        events: list[dict] = []
        async with _connect(rt, listener=listener) as ws:
            await ws.recv()
            await ws.send(_update(audio={"input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": None}}))

            async def read() -> None:
                async for m in ws:
                    events.append(json.loads(m))
                    if sum(e["type"].endswith("transcription.completed") for e in events) == num_commits:
                        return

            reader = asyncio.create_task(read())
            for i in range(num_commits):
                start = (i * half) % (len(speech) - half)
                await ws.send(_append(speech[start : start + half]))
                await ws.send(COMMIT)
                if i == 10:
                    started.set()
            await asyncio.wait_for(reader, 120)
        return events

    async def both() -> tuple[list[dict], list[int], int]:
        started = asyncio.Event()
        task = asyncio.create_task(burst(started))
        await started.wait()
        await asyncio.sleep(0.2)
        free = min(await asyncio.to_thread(lambda: [rt.readyz()["free_slots"] for _ in range(5)]))
        tokens = await _ws_tokens(rt, neighbour, listener=listener)
        return await task, tokens, free

    events, tokens, free = asyncio.run(both())
    assert free >= 1, f"the burst held every slot (free {free} of {NUM_SLOTS})"
    assert tokens == quiet
    assert not [e for e in events if e["type"] == "error"], [e for e in events if e["type"] == "error"][:3]
    assert sum(e["type"].endswith("transcription.completed") for e in events) == num_commits
    rt.assert_no_leak()


# ----------------------------------------------------------------------------- defect 4: forged secrets


@pytest.mark.parametrize(
    "path, header",
    [
        ("/v1/realtime", b"Authorization: Bearer ek_\xb2_a_b\r\n"),
        ("/v1/realtime?token=ek_%C2%B2_a_b", b""),
        ("/v1/realtime", b"Authorization: Bearer ek_" + b"9" * 5000 + b"_a_b\r\n"),
        ("/v1/realtime", b"Sec-WebSocket-Protocol: realtime, realtime-token.ek_" + b"8" * 5000 + b"_a_b\r\n"),
        ("/v1/realtime?token=ek_" + "7" * 5000 + "_n_m", b""),
    ],
    ids=["latin1-digit", "query-unicode-digit", "5000-digits", "subprotocol-5000-digits", "query-5000-digits"],
)
@pytest.mark.parametrize("listener", LISTENERS)
def test_forged_client_secret_is_401_not_500(rt, path, header, listener):
    """Defect 4: str.isdigit() accepts '²' and int() refuses it (or 5,000 digits): a 500 with a
    traceback before authentication. Now 401 with the short reason."""
    status, data = raw_handshake(rt, path, header, listener)
    assert status == 401, data[:300]
    assert b"missing or wrong bearer token" in data
    expired, _ = mint_client_secret(TOKEN, now=time.time() - 3600)
    assert raw_handshake(rt, "/v1/realtime", f"Authorization: Bearer {expired}\r\n".encode(), listener)[0] == 401


# ----------------------------------------------------------------------------- scripted bad inputs (defect 9)

BIG = "9" * 4000
SCRIPT = [  # (frame, what the error message must say)
    ("{not json", "the event is not valid JSON"),
    ("[1, 2]", "an event must be a JSON object"),
    (json.dumps({"type": 5}), "missing or invalid 'type'"),
    (json.dumps({"type": "response.create"}), "'response.create' is not supported by a transcription session"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "@@@"}), "'audio' is not valid base64"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}), "'audio' of 3 bytes is not whole 16-bit samples"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": 12}), "'audio' must be a base64 string"),
    (b"\x00\x01", "binary frames are not part of this protocol"),
    (_update(audio={"input": {"format": {"type": "audio/pcm", "rate": 5}}}), "rate: Input should be greater than or equal to 8000"),
    (_update(audio={"input": {"format": {"type": "audio/pcmu"}}}), "audio format 'audio/pcmu' is not supported; use audio/pcm"),
    (json.dumps({"type": "session.update", "session": {"type": "realtime"}}), "this server only has transcription sessions"),
    (_update(audio={"input": {"turn_detection": {"type": "foo"}}}),
     "turn_detection.type 'foo' is not supported; valid: server_vad, semantic_vad, or null for none"),
    (json.dumps({"type": "transcription_session.update", "session": {"turn_detection": {"type": "foo"}}}),
     "turn_detection.type 'foo' is not supported; valid: server_vad, semantic_vad"),
    (_update(audio={"input": {"transcription": {"model": "foo"}}}), "transcription model 'foo' is not served; served: "),
    (_update(audio={"input": {"transcription": {"model": "x" * 4000}}}), "transcription model 'xxxxxxxx"),
    ('{"type": "session.update", "session": {"context_right": ' + BIG + "}}", "context_right: Input should be less than or equal to 1000"),
    ('{"type": "session.update", "session": {"audio": {"input": {"format": {"rate": ' + BIG + "}}}}}", "rate: Input should be less than"),
    (_update(audio={"input": {"turn_detection": {"silence_duration_ms": "x"}}}), "silence_duration_ms: Input should be a valid integer"),
    (COMMIT, "buffer is empty: no audio was appended since the last commit"),
]


@pytest.mark.parametrize("listener", LISTENERS)
def test_scripted_bad_inputs_get_short_errors_in_the_clients_terms(rt, speech, listener):
    """Defect 9: each bad event gets one `error` event that says what was wrong in the client's
    terms, at most a few hundred characters (a 4,000-character value is cut, never echoed
    whole); an unknown turn_detection type or transcription model is refused (they were
    accepted silently), the model error naming the served model. The session goes on: a valid
    update naming OpenAI's model, an append and a commit transcribe."""

    async def run() -> list[dict]:
        async with _connect(rt, listener=listener) as ws:
            await ws.recv()
            errors = []
            for frame, _ in SCRIPT:
                await ws.send(frame)
                errors.append(json.loads(await ws.recv()))
            await ws.send(_update(audio={"input": {"format": {"type": "audio/pcm", "rate": RATE},
                                                   "transcription": {"model": "gpt-4o-transcribe"}, "turn_detection": None}}))  # fmt: skip
            await ws.send(_append(speech[: 2 * RATE]))
            await ws.send(COMMIT)
            rest = []
            async for m in ws:
                rest.append(json.loads(m))
                if rest[-1]["type"].endswith("transcription.completed"):
                    return errors + rest
        return errors

    events = asyncio.run(run())
    for (frame, expected), ev in zip(SCRIPT, events):
        assert ev["type"] == "error", (frame[:80], ev)
        message = ev["error"]["message"]
        assert expected in message and len(message) <= 300, (frame[:80], message[:400])
    assert rt.readyz()["model"] in events[13]["error"]["message"]  # the served model, by name
    assert [e["type"] for e in events[len(SCRIPT):]][:2] == ["session.updated", "input_audio_buffer.committed"]
    assert events[-1]["type"].endswith("transcription.completed") and events[-1]["transcript"]
    rt.assert_no_leak()


@pytest.mark.parametrize("value", ["%C2%B2", BIG, "abc", "-1"])
@pytest.mark.parametrize("listener", LISTENERS)
def test_bad_context_right_in_the_url_is_refused_with_the_served_modes(rt, value, listener):
    """Defect 9: `?context_right=abc` answered `invalid literal for int() with base 10: 'abc'`, and
    a 4,000-digit value int()'s digit-limit error. Now: error, close 1008, the served modes."""

    async def run() -> tuple[list[dict], int, str]:
        async with _connect(rt, uri_suffix=f"?context_right={value}", listener=listener) as ws:
            return await messages_until_close(ws), ws.close_code, ws.close_reason

    events, code, reason = asyncio.run(run())
    errors = [e for e in events if e["type"] == "error"]
    assert code == 1008 and len(errors) == 1, (code, events)
    message = errors[0]["error"]["message"]
    assert "invalid query parameter context_right" in message and "served modes" in message, message
    assert "int()" not in message and "base 10" not in message and len(message) <= 200, message


# ----------------------------------------------------------------------------- seeded fuzz


def _fuzz_events(rng: np.random.Generator, pcm: np.ndarray, n: int) -> list:
    """`n` frames: valid events, the same with fields swapped for odd values, and junk."""
    odd = [None, -1, 0, 2**64, 1.5, "", "x" * 300, [], {}, {"a": {"b": [1]}}, True, "9" * 500, "\u00b2", "\u202e\x00"]
    kinds = ["session.update", "transcription_session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
             "input_audio_buffer.clear", "response.create", "", None]  # fmt: skip
    frames: list = []
    for _ in range(n):
        r = rng.random()
        if r < 0.35:
            start = int(rng.integers(0, len(pcm) - 1600))
            frames.append(_append(pcm[start : start + int(rng.integers(0, 1600))]))
        elif r < 0.45:
            frames.append(COMMIT)
        elif r < 0.8:
            session = {"type": "transcription", "context_right": odd[int(rng.integers(len(odd)))],
                       "audio": {"input": {"format": {"type": "audio/pcm", "rate": odd[int(rng.integers(len(odd)))]},
                                           "transcription": {"model": odd[int(rng.integers(len(odd)))],
                                                             "language": odd[int(rng.integers(len(odd)))]},
                                           "turn_detection": {"type": odd[int(rng.integers(len(odd)))],
                                                              "silence_duration_ms": odd[int(rng.integers(len(odd)))]}}}}  # fmt: skip
            ev = {"type": kinds[int(rng.integers(len(kinds)))], "session": session, "audio": odd[int(rng.integers(len(odd)))]}
            frames.append(json.dumps(ev, ensure_ascii=bool(rng.integers(2))))
        elif r < 0.9:
            frames.append(bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8)))
        else:
            text = json.dumps({"type": "session.update", "session": {"audio": {"input": {}}}})
            cut = int(rng.integers(1, len(text)))
            frames.append(text[:cut] + "\x00" * int(rng.integers(0, 3)))
    return frames


@pytest.mark.parametrize("listener", LISTENERS)
def test_seeded_fuzz_of_json_events(rt, speech, listener):
    """400 frames in 8 sessions (seed 45) on each listener: every answer is a protocol event, a fatal one closes
    1008 (never 1011), the server log holds no traceback (module fixture) and every slot comes
    back."""
    rng = np.random.default_rng(45)
    codes: list[int | None] = []

    async def one(frames: list) -> list[dict]:
        from websockets.exceptions import ConnectionClosed

        events = []
        async with _connect(rt, listener=listener) as ws:
            try:
                for f in frames:
                    await ws.send(f)
                await ws.send(json.dumps({"type": "input_audio_buffer.done"}))
                async with asyncio.timeout(30):
                    async for m in ws:
                        events.append(json.loads(m))
            except ConnectionClosed:
                pass
            codes.append(ws.close_code)
        return events

    for _ in range(8):
        events = asyncio.run(one(_fuzz_events(rng, speech, 50)))
        assert events and all(isinstance(e.get("type"), str) for e in events)
        for e in events:
            if e["type"] == "error":
                assert 0 < len(e["error"]["message"]) <= 600, e
                assert e["error"]["type"] == "invalid_request_error", e  # never a server_error
    assert set(codes) <= {1000, 1008}, codes
    rt.assert_no_leak()


# ----------------------------------------------------------------------------- churn, neighbour, memory


async def _churn_once(rt, speech, how: str, rng: np.random.Generator, listener: str) -> None:
    """A session streaming audio with commits, its results flowing, ended by `how` mid-stream.

    With 3 slots, the neighbour's and two churn sessions' (each may hold two: the item being
    appended and the one finishing) can exceed them, and the slots of a session just cut off come
    back a moment after its socket closes: a 503 at the handshake, or a 1013 close when the slot
    is taken at the first append (a slot taken between the two), is the server refusing
    correctly, so the session waits and tries again (bounded); the test's leak check at the end
    still sees every slot come back. (A CI run beside heavy load saw the 1013.)"""
    from websockets.exceptions import ConnectionClosedError, InvalidStatus

    for _ in range(100):
        try:
            await _churn_connected(rt, speech, how, rng, listener)
            return
        except InvalidStatus as e:
            if e.response.status_code != 503:
                raise
        except ConnectionClosedError as e:
            if e.rcvd is None or e.rcvd.code != 1013:
                raise
        await asyncio.sleep(0.1)
    raise AssertionError("a churn session was refused for 10 s: slots did not come back")


async def _churn_connected(rt, speech, how: str, rng: np.random.Generator, listener: str) -> None:
    async with _connect(rt, listener=listener) as ws:
        await ws.recv()
        await ws.send(_update())
        for i in range(int(rng.integers(2, 12))):
            start = (i * 1600) % (len(speech) - 1600)
            await ws.send(_append(speech[start : start + 1600]))
            if i % 4 == 3:
                await ws.send(COMMIT)
        await asyncio.sleep(float(rng.uniform(0, 0.3)))  # the server is sending deltas and items
        transport = ws.transport
        if how == "rst":
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            transport.abort()
        elif how == "fin":
            transport.close()  # no close frame
        elif how == "half_frame":
            transport.write(b"\x81\xfe\x10\x00" + b'{"type": "input_audio_buffer.append", "au')  # 4 kB declared
            transport.close()
        else:
            await ws.close()


@pytest.mark.parametrize("listener", LISTENERS)
def test_churn_with_a_neighbour_compared_token_for_token(rt, speech, listener):
    """40 sessions ended by RST, FIN, a half frame or a clean close while the server sends, two at
    a time, beside a /ws neighbour on the same listener: its tokens equal a quiet run; every slot
    comes back; the front end's and the core's RSS grow by less than 150 MB."""
    neighbour = speech[: 6 * RATE]
    quiet = asyncio.run(_ws_tokens(rt, neighbour, listener=listener))
    pids = [rt.readyz()["pid"]] + [c["pid"] for c in rt.readyz()["cores"]]
    before = [_rss_kib(p) for p in pids]
    rng = np.random.default_rng(7)
    ways = ["rst", "fin", "half_frame", "clean"]

    opened = asyncio.Event()

    async def churn() -> None:
        await opened.wait()  # the neighbour holds its slot before the churn can take them all
        for i in range(0, 40, 2):
            await asyncio.gather(*[_churn_once(rt, speech, ways[(i + k) % 4], rng, listener) for k in range(2)])

    async def both() -> list[int]:
        task = asyncio.create_task(churn())
        tokens = await _ws_tokens(rt, neighbour, opened, listener)
        await task
        return tokens

    assert asyncio.run(both()) == quiet
    rt.assert_no_leak()
    grown = [(_rss_kib(p) - b) / 1024 for p, b in zip(pids, before)]
    print(f"RSS growth MB (front end, cores): {grown}")
    assert max(grown) < 150, grown
