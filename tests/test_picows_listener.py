"""--fast-ws-port: the streaming routes again through picows (server/picows_listener.py), against the
real server. The same sessions run behind it, so these tests check what the listener itself owns:
tokens equal to NeMo's loop, the subprotocol, frame and message size, invalid UTF-8, the caps, the
handshake deadline, a client that stops reading, the session's idle timeout reached through it,
the drain, and the keepalive timer (through the server: test_keepalive.py). Where the uvicorn port
promises the same (refusals as HTTP statuses, the caps, the request deadline), the same assertion
runs against both ports."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time

import numpy as np
import pytest

pytest.importorskip("picows")

from benchmarks.raw_ws import frame  # noqa: E402
from nemo_serve.server.ws_socket import CLOSE_TIMEOUT_S  # noqa: E402

from . import helpers  # noqa: E402
from .helpers_server import TEST_MODEL, TOKEN, encode, free_port, start_server  # noqa: E402
from .helpers_ws import (HOSTILE_ENV, messages_until_close, never_reading_client, seconds_until_closed,  # noqa: E402
                         seconds_until_slot_freed, ws_connect)
from .helpers_e2e import check_well_formed, oracle_tokens, stream  # noqa: E402

PER_IP = 4
MAX_MESSAGE_BYTES = 65536
ENV = {
    **HOSTILE_ENV,
    "NEMO_SERVE_MAX_CONNECTIONS_PER_IP": str(PER_IP),
    "NEMO_SERVE_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
}


@pytest.fixture(scope="module")
def fast():
    port = free_port()
    with start_server("--num-slots", "3", "--idle-timeout-s", "3", "--log-level", "info", "--fast-ws-port", str(port),
                      "--drain-timeout-s", "60", env=ENV) as s:  # fmt: skip
        s.fast_url = f"ws://127.0.0.1:{port}"
        s.fast_port = port
        yield s
    assert "Traceback" not in s.log(), s.log()[-4000:]


@pytest.fixture(scope="module")
def oracle_model():
    return helpers.model(TEST_MODEL, None)


async def _close_code(ws, timeout_s: float = 10.0) -> tuple[list, int | None]:
    """Every message until the close, and the close code."""
    return await messages_until_close(ws, timeout_s), ws.close_code


def test_streams_through_picows_match_oracle(fast, oracle_model):
    """int16 at 16 kHz and float32 at 8 kHz at once, odd packet sizes: NeMo's loop's tokens."""
    utts = helpers.utterances(2, seed=5)
    cases = [("pcm_s16le", 16000, 1000), ("pcm_f32le", 8000, 777)]
    wires = [encode(a if r == 16000 else helpers_resample(a, r), e) for (e, r, _), a in zip(cases, utts)]

    async def run_all():
        return await asyncio.gather(*(stream(fast.fast_url + "/ws", w, r, e, packet=p, speed=4.0)
                                      for w, (e, r, p) in zip(wires, cases)))  # fmt: skip

    for t, w, (e, r, _) in zip(asyncio.run(run_all()), wires, cases):
        check_well_formed(t)
        assert t.token_ids == oracle_tokens(oracle_model, w, r), (e, r)
    fast.assert_no_leak()


def helpers_resample(audio: np.ndarray, rate: int) -> np.ndarray:
    from .helpers_server import as_model_input

    return as_model_input(audio, 16000, rate)


def test_realtime_gets_its_subprotocol_and_session(fast):
    async def scenario():
        async with ws_connect(fast.fast_url + "/v1/realtime?intent=transcription", subprotocols=["realtime"]) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), 10))
            return ws.subprotocol, first["type"]

    subprotocol, first = asyncio.run(scenario())
    assert subprotocol == "realtime" and first.endswith("created"), (subprotocol, first)


def test_realtime_through_picows_matches_ws(fast):
    """/v1/realtime through the fast port: 20 ms appends at 24 kHz, commit; the completed item's
    tokens and text are /ws's (through uvicorn) for the same audio."""
    from .helpers_realtime import TRANSCRIPTION, b64, pcm16, tokens_and_text, ws_reference

    wire = pcm16(24000)
    session = {"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                                            "turn_detection": None}}}  # fmt: skip

    async def run() -> list[dict]:
        raw: list[dict] = []
        async with ws_connect(fast.fast_url + "/v1/realtime?intent=transcription") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            for i in range(0, len(wire), 480):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire[i : i + 480])}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            async with asyncio.timeout(60):
                async for message in ws:
                    raw.append(json.loads(message))
                    if raw[-1]["type"] == f"{TRANSCRIPTION}.completed":
                        break
        return raw

    expected = asyncio.run(ws_reference(fast, wire, 24000))
    raw = asyncio.run(run())
    assert not [e for e in raw if e["type"] == "error"], raw
    assert tokens_and_text(raw) == expected and expected[0]
    fast.assert_no_leak()


def test_frame_and_message_size_and_invalid_utf8(fast):
    """A frame over --max-message-bytes: 1009; a message over it in small fragments: 1009; a
    fragmented config under it works; a text frame that is not UTF-8: 1007. No slot is left."""

    reasons = []

    async def raw(frames: list[bytes]) -> int | None:
        ws = await ws_connect(fast.fast_url + "/ws")
        for f in frames:
            ws.transport.write(f)  # frames built here: websockets would refuse to send these
        messages, code = await _close_code(ws)
        reasons.append(ws.close_reason)
        return code, messages

    big = np.zeros(MAX_MESSAGE_BYTES // 2 + 8, "<i2").tobytes()
    code, _ = asyncio.run(raw([frame(big, 0x2)]))
    assert code == 1009
    # protocol.md's close table, the reason picows gives on this port
    assert reasons[-1] == f"Received frame with payload size exceeding max allowed size, {len(big)} > {MAX_MESSAGE_BYTES}"
    part = np.zeros(MAX_MESSAGE_BYTES // 4, np.uint8).tobytes()
    fragments = [_fragment(part, 0x2, fin=False)] + [_fragment(part, 0x0, fin=False)] * 3 + [_fragment(part, 0x0, fin=True)]
    code, _ = asyncio.run(raw(fragments))
    assert code == 1009
    code, _ = asyncio.run(raw([frame(b'{"type": "config", "x": "\xff\xfe"}', 0x1)]))
    assert code == 1007

    async def fragmented_config():
        async with ws_connect(fast.fast_url + "/ws") as ws:
            await ws.send(iter(['{"type": "con', 'fig", "sample_rate": 16000}']))
            return json.loads(await asyncio.wait_for(ws.recv(), 10))["type"]

    assert asyncio.run(fragmented_config()) == "ready"
    fast.assert_no_leak()


def _fragment(payload: bytes, opcode: int, fin: bool) -> bytes:
    f = bytearray(frame(payload, opcode))
    if not fin:
        f[0] &= 0x7F
    return bytes(f)


PORTS = ["uvicorn", "picows"]  # the same assertion against --port and --fast-ws-port


def _url(server, port: str) -> str:
    return server.fast_url if port == "picows" else f"ws://127.0.0.1:{server.port}"


async def _refused(url: str, **kw) -> tuple[int, dict, dict]:
    """(HTTP status, JSON body, headers) of an upgrade request the server refuses."""
    from websockets.exceptions import InvalidStatus

    try:
        async with ws_connect(url, **kw):
            pass
    except InvalidStatus as e:
        return e.response.status_code, json.loads(e.response.body or b"{}"), dict(e.response.headers)
    raise AssertionError(f"{url} was upgraded")


@pytest.mark.parametrize("port", PORTS)
def test_origin_and_token_refused_with_http_status(fast, port):
    """A wrong token: 401 on /ws and /v1/realtime; a foreign Origin: 403; the app's JSON reason in
    the body, as uvicorn's listener answers (websockets raises InvalidStatus with the code)."""
    url = _url(fast, port)

    async def scenario():
        wrong = {"additional_headers": {"Authorization": "Bearer wrong"}}
        foreign = {"origin": "https://evil.example", "additional_headers": {"Authorization": f"Bearer {TOKEN}"}}
        return [await _refused(url + "/ws", **wrong), await _refused(url + "/v1/realtime", **wrong),
                await _refused(url + "/ws", **foreign)]  # fmt: skip

    (s1, b1, _), (s2, _, _), (s3, b3, _) = asyncio.run(scenario())
    assert (s1, s2, s3) == (401, 401, 403)
    assert b1["reason"] == "missing or wrong bearer token" and "evil.example" in b3["reason"], (b1, b3)
    fast.assert_no_leak()


@pytest.mark.parametrize("port", PORTS)
def test_connections_per_address_are_capped_with_503_and_released(fast, port):
    """PER_IP open from one address; the next gets HTTP 503 with the reason and Retry-After; one
    closed, one more fits."""
    url = _url(fast, port) + "/ws"

    async def scenario():
        held = [await ws_connect(url) for _ in range(PER_IP)]
        refused = await _refused(url)
        await held.pop().close()
        await asyncio.sleep(0.3)
        again = await ws_connect(url)
        await again.send(json.dumps({"type": "config"}))
        ready = json.loads(await asyncio.wait_for(again.recv(), 10))["type"]
        for ws in [*held, again]:
            await ws.close()
        return refused, ready

    (status, body, headers), ready = asyncio.run(scenario())
    assert status == 503 and "too many connections from your address" in body["reason"], (status, body)
    assert headers.get("retry-after") == "1" and ready == "ready", headers
    fast.assert_no_leak()


@pytest.mark.parametrize("port", PORTS)
def test_handshakes_in_progress_count_against_the_cap(fast, port):
    """PER_IP sockets that have sent nothing hold the address's cap: an upgrade now gets 503;
    after the header deadline (1 s) they are answered 408 and the next upgrade fits."""
    tcp_port = fast.fast_port if port == "picows" else fast.port
    url = _url(fast, port) + "/ws"

    async def scenario():
        silent = [socket.create_connection(("127.0.0.1", tcp_port)) for _ in range(PER_IP)]
        await asyncio.sleep(0.2)
        status = (await _refused(url))[0]
        await asyncio.sleep(2.0)
        async with ws_connect(url) as ws:
            await ws.send(json.dumps({"type": "config"}))
            ready = json.loads(await asyncio.wait_for(ws.recv(), 10))["type"]
        for s in silent:
            s.close()
        return status, ready

    assert asyncio.run(scenario()) == (503, "ready")
    fast.assert_no_leak()


@pytest.mark.parametrize("port", PORTS)
def test_silent_socket_is_answered_408_at_the_handshake_deadline(fast, port):
    s = socket.create_connection(("127.0.0.1", fast.fast_port if port == "picows" else fast.port))
    s.settimeout(10)
    t0 = time.monotonic()
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    assert time.monotonic() - t0 < 5
    assert reply.startswith(b"HTTP/1.1 408") and b"request not received within 1 s" in reply, reply[:300]
    s.close()


def test_idle_timeout_reaches_the_session(fast):
    async def scenario():
        async with ws_connect(fast.fast_url + "/ws") as ws:
            return await _close_code(ws, 15)

    t0 = time.monotonic()
    messages, code = asyncio.run(scenario())
    assert code == 1008 and "idle timeout" in messages[-1]["reason"], messages
    assert time.monotonic() - t0 < 10


def test_client_that_never_reads_loses_its_slot(fast):
    """The send waits while picows's transport is paused, so --send-timeout-s (2 s) fails the
    stream; the client cannot take the close in CLOSE_TIMEOUT_S either: dropped (1006)."""
    label = 'nemo_serve_stream_errors_total{reason="slow_client"}'
    before = fast.metric(label)

    async def scenario():
        ws, sender = await never_reading_client(fast.fast_port, fast.fast_url + "/ws", 3000)
        freed_s = await seconds_until_slot_freed(fast, 40)
        await asyncio.sleep(2 * CLOSE_TIMEOUT_S)
        await seconds_until_closed(ws, sender)
        return freed_s, ws.close_code

    freed_s, code = asyncio.run(scenario())
    assert freed_s < 40 and code == 1006, (freed_s, code)
    assert fast.metric(label) == before + 1
    fast.assert_no_leak()


def test_sigterm_drains_a_picows_stream_to_its_final(fast):
    """SIGTERM while a stream is open on the fast port: its final and `done` (draining), then exit 0.
    It ends the module's server (a second server would cost its start-up): the last test that uses
    `fast`, and the tests below start no server of it."""
    srv = fast
    utt = helpers.utterances(1, seed=31)[0]

    async def scenario():
        client = asyncio.create_task(stream(srv.fast_url + "/ws", encode(utt, "pcm_f32le"), 16000, "pcm_f32le",
                                            speed=1.0, packet=800))  # fmt: skip
        while srv.readyz()["open_streams"] < 1:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(client, 60)

    t = asyncio.run(scenario())
    assert srv.proc.wait(30) == 0
    assert t.done is not None and t.done.get("reason") == "draining", t.messages[-2:]
    assert t.finals and t.close_code == 1000


def test_fast_port_must_differ_from_the_others():
    """Both are SO_REUSEPORT sockets: one port for two listeners would split clients between them."""
    from pydantic import ValidationError

    from nemo_serve.config import Settings

    for clash in ({"port": 9100, "fast_ws_port": 9100}, {"port": 9100, "grpc_port": 9101, "fast_ws_port": 9101}):
        with pytest.raises(ValidationError, match="--fast-ws-port 9"):
            Settings(**clash)
    assert Settings(port=9100, fast_ws_port=9102).fast_ws_port == 9102


@pytest.mark.parametrize("flag", ["--fast-ws-port", "--port", "--grpc-port"])
def test_a_port_another_program_holds_fails_start_up_in_one_line(flag):
    """As a front end whose --grpc-port fails: one line naming the flag, status 3, no traceback; and
    at once: the ports are reserved before the engine core builds the model (nothing else logged)."""
    import os
    import subprocess

    from .helpers_server import _server_command

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = {"--port": str(free_port()), "--fast-ws-port": str(free_port()), "--grpc-port": str(free_port()),
                 flag: str(taken)}  # every port the supervisor reserves (its docstring: "the same way")
        cmd = [*_server_command(), "--model", TEST_MODEL, "--host", "127.0.0.1", *(a for kv in ports.items() for a in kv)]
        done = subprocess.run(cmd, env=dict(os.environ, NEMO_SERVE_AUTH_TOKEN=TOKEN), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3 and lines == [f"nemo-serve: error: {flag} {taken} on 127.0.0.1: Address already in use"], lines


def test_picows_outside_the_tested_range_fails_at_import(monkeypatch):
    """UpgradeProtocol calls WSProtocol's private constructor: an untested picows fails at import,
    naming itself; the fastws extra's pin is inside the range."""
    import importlib
    import sys
    import tomllib
    from pathlib import Path

    from nemo_serve import versions
    from nemo_serve.server.picows_listener import PICOWS_VERSIONS

    extra = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    pin = extra["project"]["optional-dependencies"]["fastws"][0]
    assert pin.startswith("picows==") and versions.in_range(pin[8:], *PICOWS_VERSIONS), pin
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "2.4.0" if d == "picows" else real(d))
    monkeypatch.delenv("NEMO_SERVE_ALLOW_UNTESTED", raising=False)
    monkeypatch.delitem(sys.modules, "nemo_serve.server.picows_listener")
    with pytest.raises(ImportError, match=r"picows 2\.4\.0 is outside the range .*>=2\.3\.1,<2\.4"):
        importlib.import_module("nemo_serve.server.picows_listener")


class _PicowsTransport:
    """What AppConnection calls on picows's WSTransport, recorded."""

    def __init__(self) -> None:
        self.pings, self.closes, self.is_close_frame_sent = [], [], False
        self.underlying_transport = type("Tcp", (), {"abort": lambda self: None})()

    def send_ping(self, payload: bytes) -> None:
        self.pings.append(payload)

    def send_close(self, code, reason: bytes) -> None:
        self.closes.append((int(code), reason))
        self.is_close_frame_sent = True


def test_keepalive_chain_pings_every_interval_and_closes_1011_without_the_pong():
    """AppConnection's call_later chain (tests/test_keepalive.py runs it through the server): no
    timer with pings off; a ping one interval after connect; a pong with another payload is no
    answer; the right one schedules the next ping; no pong within the timeout: 1011 "keepalive ping
    timeout", also to the app. Timers fire in deadline order, so the sleeps below are not races."""
    from types import SimpleNamespace

    from nemo_serve.server.picows_listener import AppConnection

    async def app(scope, receive, send):
        while (m := await receive())["type"] != "websocket.disconnect":
            pass
        heard.append(m["code"])

    def connect(interval_s: float) -> tuple[AppConnection, _PicowsTransport]:
        settings = SimpleNamespace(ping_interval_s=interval_s, ping_timeout_s=0.2)
        c = AppConnection(SimpleNamespace(app=app, connections=set(), settings=settings), {"client": ("1.2.3.4", 5)})
        c.on_ws_connected(t := _PicowsTransport())
        return c, t

    heard: list[int] = []

    async def scenario():
        (off, off_t), (c, t) = connect(0.0), connect(0.05)
        await asyncio.sleep(0.08)  # first ping at 0.05
        assert off.ping_timer is None and t.pings and len(t.pings[0]) == 4, t.pings
        c._on_pong(b"xxxx")  # unsolicited: still waiting
        assert c.ping_payload == t.pings[0] and not t.closes
        c._on_pong(t.pings[0])
        assert c.ping_payload is None and c.ping_timer is not None
        await asyncio.sleep(0.08)  # next ping at 0.10 (the interval less the round trip), deadline 0.30
        assert len(t.pings) == 2 and not t.closes, t.pings
        await asyncio.sleep(0.3)
        assert t.closes == [(1011, b"keepalive ping timeout")] and heard == [1011], (t.closes, heard)
        assert off_t.pings == [] and off_t.closes == []
        off.on_ws_disconnected(off_t)
        await off.task

    asyncio.run(scenario())


def test_a_ping_timeout_longer_than_the_interval_is_accepted():
    """--ping-timeout-s 20 with --ping-interval-s 5 is a valid uvicorn setting; picows's own
    auto-ping asserted timeout <= interval in every connection's constructor."""
    from types import SimpleNamespace

    from nemo_serve.server.picows_listener import UpgradeProtocol

    async def construct():
        settings = SimpleNamespace(ping_interval_s=5.0, ping_timeout_s=20.0, max_message_bytes=1 << 20)
        return UpgradeProtocol(SimpleNamespace(settings=settings, limits=None))

    assert asyncio.run(construct()) is not None


def test_a_failure_in_the_upgrade_answer_is_logged_and_500_without_its_text(caplog):
    """picows answers an exception from the listener factory with HTTP 500 carrying the exception's
    text, and logs nothing: a forged secret's non-ASCII header byte did that (test_hostile_realtime),
    invisible to every "no traceback in the log" check. The listener answers it itself: the
    traceback in the server log, a 500 with a generic JSON reason to the client."""
    from types import SimpleNamespace

    from multidict import CIMultiDict

    from nemo_serve.server.picows_listener import FastWsListener

    def refusal(conn):
        raise ValueError("secret detail of a server bug")

    app = SimpleNamespace(state=SimpleNamespace(handshake_refusal=refusal))
    listener = FastWsListener(app, None, SimpleNamespace(max_message_bytes=1 << 20, tls=False))
    request = SimpleNamespace(path=b"/ws", headers=CIMultiDict({"Host": "127.0.0.1"}))
    with caplog.at_level(logging.ERROR, logger="nemo_serve.connections"):
        answer = listener.route(request, ("127.0.0.1", 5))
    head = bytes(answer.response.to_bytes())
    assert head.startswith(b"HTTP/1.1 500") and answer.listener is None, head
    assert b"secret detail" not in head and b"internal server error" in head, head
    assert "secret detail of a server bug" in caplog.text and "Traceback" in caplog.text, caplog.text
