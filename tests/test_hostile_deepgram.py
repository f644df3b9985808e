"""/v1/listen under hostile and careless clients, as tests/test_hardening.py holds /ws and
test_hostile_realtime.py /v1/realtime: refusals before the upgrade, abrupt ends, a seeded fuzz
and a KeepAlive flood beside a paced neighbour compared transcript for transcript, slots and the
front end's memory checked after. Every test runs on both listeners (uvicorn --port, picows
--fast-ws-port), which hand frames and closes to the session each its own way. The shared
server (helpers_server.deepgram_server) fails at its teardown if its log holds a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from . import helpers
from .helpers_server import DEEPGRAM_NUM_SLOTS, LISTENERS, TOKEN
from .helpers_ws import masked_frame, messages_until_close, raw_handshake, raw_upgrade, ws_connect

RATE = 16000
PACKET = RATE // 10
QUERY = "?encoding=linear16&sample_rate=16000&interim_results=true"
TYPES = {"Results", "Metadata", "SpeechStarted", "UtteranceEnd", "Error", "ConfigureFailure"}


@pytest.fixture(scope="module")
def pcm() -> np.ndarray:
    audio = np.concatenate(helpers.utterances(2, seed=3))
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")


def _connect(server, listener: str, query: str = QUERY):
    return ws_connect(server.ws_base(listener) + "/v1/listen" + query, additional_headers={"Authorization": f"Token {TOKEN}"})


async def _finals(server, listener: str, pcm: np.ndarray, pace_s: float = 0.0, opened: asyncio.Event | None = None,
                  extra=None) -> list[str]:  # fmt: skip
    """One /v1/listen stream of `pcm` in 100 ms packets (`pace_s` apart; `extra(ws, i)` may send
    more after packet i), CloseStream: its final transcripts, after checking that only Results
    and Metadata came, and then close 1000."""
    async with _connect(server, listener) as ws:
        for i in range(0, len(pcm), PACKET):
            await ws.send(pcm[i : i + PACKET].tobytes())
            if opened is not None and i == 0:
                opened.set()
            if extra is not None:
                await extra(ws, i)
            await asyncio.sleep(pace_s)
        await ws.send(json.dumps({"type": "CloseStream"}))
        messages = await messages_until_close(ws, 60)
    assert messages[-1]["type"] == "Metadata" and ws.close_code == 1000, (messages[-2:], ws.close_code)
    assert {m["type"] for m in messages} == {"Results", "Metadata"}, messages  # nothing else was asked for
    return [m["channel"]["alternatives"][0]["transcript"] for m in messages if m["type"] == "Results" and m["is_final"]]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


# ----------------------------------------------------------------------------- before the upgrade


@pytest.mark.parametrize("header", [b"", b"Authorization: Token wrong\r\n", b"Authorization: Bearer wrong\r\n"],
                         ids=["none", "wrong-token-scheme", "wrong-bearer"])  # fmt: skip
@pytest.mark.parametrize("listener", LISTENERS)
def test_missing_or_wrong_key_is_401_before_accept(deepgram_server, header, listener):
    """No key or a wrong one: HTTP 401 with the reason, no upgrade; a bad query too (auth first)."""
    for path in ("/v1/listen" + QUERY, "/v1/listen?encoding=mulaw"):
        status, data = raw_handshake(deepgram_server, path, header, listener)
        assert status == 401, data[:300]
        assert b"missing or wrong bearer token" in data


BAD_QUERIES = {
    "no-encoding": ("?sample_rate=16000", b"encoding is required"),
    "mulaw": ("?encoding=mulaw&sample_rate=8000", b"encoding 'mulaw' is not supported"),
    "no-rate": ("?encoding=linear16", b"sample_rate is required"),
    "rate-text": ("?encoding=linear16&sample_rate=abc", b"sample_rate='abc'"),
    "rate-low": ("?encoding=linear16&sample_rate=4000", b"sample_rate='4000'"),
    "stereo": ("?encoding=linear16&sample_rate=16000&channels=2", b"channels='2'"),
    "multichannel": ("?encoding=linear16&sample_rate=16000&multichannel=true", b"multichannel=true"),
    "interim-maybe": ("?encoding=linear16&sample_rate=16000&interim_results=maybe", b"interim_results='maybe'"),
    "endpointing-neg": ("?encoding=linear16&sample_rate=16000&endpointing=-5", b"endpointing='-5'"),
    "utterance-end-0": ("?encoding=linear16&sample_rate=16000&utterance_end_ms=0", b"utterance_end_ms='0'"),
    "punctuate-digit": ("?encoding=linear16&sample_rate=16000&punctuate=%C2%B2", b"punctuate="),
    "keyword-suppress": ("?encoding=linear16&sample_rate=16000&keywords=gl:-2", b"(suppression) is not supported"),
    "keywords-weights": ("?encoding=linear16&sample_rate=16000&keywords=gl:2&keywords=do:3", b"one intensifier"),
    "keyterm-unspellable": ("?encoding=linear16&sample_rate=16000&keyterm=%E4%B8%AD", b"cannot spell"),
}


@pytest.mark.parametrize("listener", LISTENERS)
def test_bad_query_is_400_before_a_slot(deepgram_server, listener):
    """Each bad parameter: HTTP 400 with its reason before the upgrade, counted as a bad_request
    refusal; no slot taken, none opened."""
    series = 'nemo_serve_refusals_total{reason="bad_request"}'
    before = deepgram_server.metric(series)
    for name, (query, reason) in BAD_QUERIES.items():
        status, data = raw_handshake(deepgram_server, "/v1/listen" + query, f"Authorization: Token {TOKEN}\r\n".encode(),
                                  listener)  # fmt: skip
        assert status == 400 and reason in data, (name, data[:400])
        ready = deepgram_server.readyz()
        assert ready["free_slots"] == DEEPGRAM_NUM_SLOTS and ready["open_streams"] == 0, (name, ready)
    assert deepgram_server.metric(series) - before == len(BAD_QUERIES)


# ----------------------------------------------------------------------------- scripted inputs

CLOSE = json.dumps({"type": "CloseStream"})
SCRIPTS = {  # name -> (frames, after the audio packet; the message types expected in order; close code)
    "closestream-first": ([CLOSE], ["Metadata"], 1000),
    "empty-binary-closes": ([b""], ["Results", "Metadata"], 1000),
    "configure-refused": ([json.dumps({"type": "Configure", "keyterms": ["x"]}), CLOSE],
                          ["ConfigureFailure", "Results", "Metadata"], 1000),
    "not-json": (["hello"], ["Error"], 1008),
    "unknown-type": ([json.dumps({"type": "Flush"})], ["Error"], 1008),
    "no-type": ([json.dumps([1, 2])], ["Error"], 1008),
    "odd-bytes": ([b"\x00\x01\x02"], ["Error"], 1008),
    "deep-json": (["[" * 100_000], ["Error"], 1008),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
@pytest.mark.parametrize("listener", LISTENERS)
def test_scripted_inputs_get_deepgrams_answers(deepgram_server, pcm, name, listener):
    """Each scripted input after 0.5 s of audio (none before "closestream-first"): the message
    types expected (consecutive Results as one), an Error as a DataError with a short
    description, the close code."""
    frames, expected, code = SCRIPTS[name]

    async def run() -> tuple[list[dict], int]:
        async with _connect(deepgram_server, listener, "?encoding=linear16&sample_rate=16000") as ws:
            if name != "closestream-first":
                await ws.send(pcm[: RATE // 2].tobytes())
            for f in frames:
                await ws.send(f)
            return await messages_until_close(ws, 30), ws.close_code

    messages, close_code = asyncio.run(run())
    types = [m["type"] for m in messages]
    assert [t for i, t in enumerate(types) if t != "Results" or types[i - 1 : i] != ["Results"]] == expected, types
    assert close_code == code, (close_code, messages)
    for e in (m for m in messages if m["type"] == "Error"):
        assert e["variant"] == "DataError" and 0 < len(e["description"]) <= 200, e
    deepgram_server.assert_no_leak()


# ----------------------------------------------------------------------------- abrupt ends


@pytest.mark.parametrize("how", ["rst", "fin", "close-frame", "rst-after-closestream", "close-after-closestream"])
@pytest.mark.parametrize("listener", LISTENERS)
def test_abrupt_disconnect_leaks_no_slot(deepgram_server, pcm, how, listener):
    """1 s of audio in one write (with CloseStream where `how` says), then the connection cut:
    TCP RST, FIN without a close frame, or a close frame at once; five times: every slot comes back."""
    audio = b"".join(masked_frame(pcm[i : i + PACKET].tobytes(), opcode=2) for i in range(0, RATE, PACKET))
    if how.endswith("after-closestream"):
        audio += masked_frame(json.dumps({"type": "CloseStream"}).encode())
    for _ in range(5):
        with _upgrade_when_admitted(deepgram_server, listener) as s:
            s.sendall(audio)
            if how.startswith("rst"):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif how.startswith("close"):
                s.sendall(masked_frame(struct.pack(">H", 1000), opcode=8))
    deepgram_server.assert_no_leak(timeout_s=10)


def _upgrade_when_admitted(server, listener: str) -> socket.socket:
    """A raw socket past the /v1/listen upgrade. The slots of a connection just cut come back a
    moment later (between steps): a 503 meanwhile is admission refusing correctly, so try again
    (bounded); the leak check after still sees every slot come back."""
    for _ in range(100):
        try:
            return raw_upgrade(server.ws_port(listener), "/v1/listen" + QUERY)
        except AssertionError as e:
            if b" 503 " not in str(e).encode():
                raise
            time.sleep(0.1)
    raise AssertionError("refused for 10 s: slots did not come back")


# ----------------------------------------------------------------------------- fuzz beside a neighbour


def _fuzz_frames(rng: np.random.Generator, pcm: np.ndarray, n: int) -> list:
    """`n` frames: audio, the control messages, the same with odd fields, odd-length and random
    binary, truncated and deeply nested JSON, text that is not JSON."""
    odd = [None, -1, 0, 2**64, 1.5, "", "x" * 300, [], {}, True, "9" * 500, "\u00b2", "\u202e\x00"]
    kinds = ["KeepAlive", "Finalize", "Configure", "Results", "keepalive", "", None, 7]
    frames: list = []
    for _ in range(n):
        r = rng.random()
        if r < 0.35:
            start = int(rng.integers(0, len(pcm) - PACKET))
            frames.append(pcm[start : start + int(rng.integers(1, PACKET))].tobytes())
        elif r < 0.5:
            frames.append(json.dumps({"type": ["KeepAlive", "Finalize"][int(rng.integers(2))]}))
        elif r < 0.7:
            message = {"type": kinds[int(rng.integers(len(kinds)))], "keyterms": odd[int(rng.integers(len(odd)))],
                       "channel": odd[int(rng.integers(len(odd)))]}  # fmt: skip
            frames.append(json.dumps(message, ensure_ascii=bool(rng.integers(2))))
        elif r < 0.85:
            frames.append(bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8)))
        elif r < 0.93:
            text = json.dumps({"type": "Finalize"})
            frames.append(text[: int(rng.integers(1, len(text)))] + "\x00" * int(rng.integers(0, 3)))
        else:
            frames.append("[" * int(rng.integers(1000, 100_000)))
    return frames


async def _fuzz_session(server, listener: str, frames: list, codes: list) -> list[dict]:
    """One fuzzed session. The slot of the session before, cut at its error, comes back a moment
    after its close (between steps): a 503 meanwhile is admission refusing correctly, so the
    session tries again (bounded)."""
    from websockets.exceptions import InvalidStatus

    for _ in range(100):
        try:
            return await _fuzz_connected(server, listener, frames, codes)
        except InvalidStatus as e:
            if e.response.status_code != 503:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("a fuzz session was refused for 10 s: slots did not come back")


async def _fuzz_connected(server, listener: str, frames: list, codes: list) -> list[dict]:
    from websockets.exceptions import ConnectionClosed

    async with _connect(server, listener) as ws:
        try:
            for f in frames:
                await ws.send(f)
            await ws.send(json.dumps({"type": "CloseStream"}))
        except ConnectionClosed:
            pass
        messages = await messages_until_close(ws, 30)
        codes.append(ws.close_code)
    return messages


@pytest.mark.parametrize("listener", LISTENERS)
def test_seeded_fuzz_beside_a_paced_neighbour(deepgram_server, pcm, listener):
    """8 sessions of 40 fuzzed frames (seed 61) one after another, beside a neighbour streaming
    at twice real time on the same listener: every answer is a Deepgram message, an Error is a
    DataError (never a ServerError) and closes 1008, other ends close 1000; the neighbour's
    finals equal a quiet run's; every slot comes back."""
    neighbour = pcm[: 5 * RATE]
    quiet = asyncio.run(_finals(deepgram_server, listener, neighbour))
    rng = np.random.default_rng(61)
    codes: list = []

    async def both() -> tuple[list[str], list[list[dict]]]:
        opened = asyncio.Event()
        task = asyncio.create_task(_finals(deepgram_server, listener, neighbour, 0.05, opened))
        await opened.wait()
        sessions = [await _fuzz_session(deepgram_server, listener, _fuzz_frames(rng, pcm, 40), codes) for _ in range(8)]
        return await task, sessions

    finals, sessions = asyncio.run(both())
    assert finals == quiet
    for messages in sessions:
        assert all(m.get("type") in TYPES for m in messages), messages
        errors = [m for m in messages if m["type"] == "Error"]
        assert all(e["variant"] == "DataError" and 0 < len(e["description"]) <= 600 for e in errors), errors
    assert set(codes) <= {1000, 1008} and 1008 in codes, codes
    deepgram_server.assert_no_leak()


@pytest.mark.parametrize("listener", LISTENERS)
def test_keepalive_flood_is_bounded(deepgram_server, pcm, listener):
    """A client that sends 200 KeepAlives after every 100 ms packet (15,000 in all, as fast as the
    socket takes them) beside a paced neighbour: nothing is sent back for them, its own finals and
    the neighbour's equal quiet runs, the front end's RSS grows by less than 50 MB and every slot
    comes back."""
    flooded_audio, neighbour = pcm[: 75 * PACKET], pcm[: 4 * RATE]
    quiet_flooded = asyncio.run(_finals(deepgram_server, listener, flooded_audio))
    quiet_neighbour = asyncio.run(_finals(deepgram_server, listener, neighbour))
    pid = deepgram_server.readyz()["pid"]
    before = _rss_kib(pid)
    keepalive = json.dumps({"type": "KeepAlive"})

    async def flood(ws, i: int) -> None:
        for _ in range(200):
            await ws.send(keepalive)

    async def both() -> tuple[list[str], list[str]]:
        opened = asyncio.Event()
        task = asyncio.create_task(_finals(deepgram_server, listener, neighbour, 0.05, opened))
        await opened.wait()
        t0 = time.monotonic()
        flooded = await _finals(deepgram_server, listener, flooded_audio, extra=flood)
        print(f"15,000 KeepAlives and 7.5 s of audio in {time.monotonic() - t0:.2f} s")
        return flooded, await task

    flooded, finals = asyncio.run(both())
    assert flooded == quiet_flooded and finals == quiet_neighbour
    grown_mb = (_rss_kib(pid) - before) / 1024
    print(f"front end RSS growth: {grown_mb:.1f} MB")
    assert grown_mb < 50, grown_mb
    deepgram_server.assert_no_leak()
