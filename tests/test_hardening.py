"""The front door under hostile clients (issue 14): one regression test per defect, then a
small fuzz run. The real `nemo-serve` process, with its own small limits given through the
environment (NEMO_SERVE_*): pings off (so nothing but our own limits frees a stalled
client), a 2 s send timeout, a 1 s header timeout, 10 connections per address and 24 in
all, one allowed foreign Origin, and an info-level log that the tests read.

The server serves /ws on both WebSocket listeners, uvicorn (--port) and picows (--fast-ws-port):
what bad messages do to a session (odd JSON types, a non-ASCII reason, the seeded fuzz) runs
against both (`listener`), since each hands frames and closes to the session its own way. The rest
stays on --port: HTTP routes and uvicorn's access lines (secrets, the 408 of an HTTP request); the
caps, the request deadline, origins and a client that never reads are the listener's own and run
against both ports in test_picows_listener.py; a long segment's partials and the drain are the
session's and the server's, whichever listener carries them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.fuzz_server import fuzz
from benchmarks.raw_ws import frame as client_frame
from nemo_serve.oracle import oracle_transcribe
from nemo_serve.server.ws_socket import CLOSE_TIMEOUT_S

from . import helpers
from .helpers_hostile_files import multipart, upload_head, wav_bytes
from .helpers_server import LISTENERS, TEST_MODEL, TOKEN, raw_session, start_server
from .helpers_ws import (HOSTILE_ENV, messages_until_close, never_reading_client, raw_upgrade, seconds_until_closed,
                         seconds_until_slot_freed, speech, ws_connect)

PER_IP = 10
TOTAL = 24
HARD_ENV = {
    **HOSTILE_ENV,
    "NEMO_SERVE_MAX_CONNECTIONS": str(TOTAL),
    "NEMO_SERVE_MAX_CONNECTIONS_PER_IP": str(PER_IP),
    "NEMO_SERVE_ALLOWED_ORIGINS": "https://app.example.com",
}
HARD_ARGS = ("--num-slots", "3", "--idle-timeout-s", "20", "--log-level", "info")


@pytest.fixture(scope="module")
def hard():
    with start_server(*HARD_ARGS, env=HARD_ENV, fast_ws=True) as s:
        yield s
    assert "Traceback" not in s.log(), s.log()[-4000:]


def _log_since(server, offset: int) -> str:
    time.sleep(0.3)  # the server's log lines are written as they happen; let the last ones land
    return server.log()[offset:]


# ----------------------------------------------------------------------------- 1 secrets


def test_token_in_query_is_never_logged(hard):
    """Defect 1: uvicorn's access line printed `?token=T`."""
    start = len(hard.log())
    messages, code = asyncio.run(raw_session(hard.ws_url + f"?token={TOKEN}", ["Done"], token=None))
    assert messages[-1]["type"] == "done" and code == 1000
    assert hard.get(f"/readyz?token={TOKEN}").status_code == 200
    log = _log_since(hard, start)
    assert "WebSocket /ws" in log and "GET /readyz" in log, log  # the access lines are there ...
    assert TOKEN not in log, log  # ... without the secret
    hard.assert_no_leak()


# ----------------------------------------------------------------------------- 2 log flooding


def test_log_lines_bounded_in_size_and_rate(hard):
    """Defect 2: a 600 kB `type` echoed whole in the reply and the log; a traceback per invalid
    UTF-8 frame; a handshake error line per 401; one line or more per bad connection."""
    from websockets.exceptions import InvalidStatus

    from nemo_serve.server.logsafe import BURST, RATE_PER_S

    start, t0 = len(hard.log()), time.monotonic()

    async def scenario():
        big = []
        for _ in range(5):
            big.append(await raw_session(hard.ws_url, [json.dumps({"type": "A" * 600_000 + "\x1b[31m"})]))
        bad_utf8 = []
        for _ in range(10):
            async with ws_connect(hard.ws_url) as ws:
                await ws.send(b'{"type": "\xff"}', text=True)
                await ws.wait_closed()
                bad_utf8.append(ws.close_code)
        refused = []
        for _ in range(10):
            try:
                async with ws_connect(hard.ws_url, additional_headers={"Authorization": "Bearer wrong"}):
                    refused.append(101)
            except InvalidStatus as e:
                refused.append(e.response.status_code)
        for _ in range(30):  # 150 bad connections, 5 at a time (under the per-address cap)
            flood = await asyncio.gather(*(raw_session(hard.ws_url, ['{"type": "pause"}']) for _ in range(5)))
            assert all(code == 1008 for _, code in flood)
        await asyncio.sleep(1.0 / RATE_PER_S + 0.1)
        await raw_session(hard.ws_url, ['{"type": "pause"}'])  # its line says how many were dropped
        return big, bad_utf8, refused

    big, bad_utf8, refused = asyncio.run(scenario())
    elapsed_s = time.monotonic() - t0
    for messages, code in big:
        reason = messages[-1]["reason"]
        assert code == 1008 and "unknown message type" in reason and len(reason) < 300, (code, reason[:300])
        assert "\x1b" not in reason
    assert bad_utf8 == [1007] * 10 and refused == [401] * 10
    log = _log_since(hard, start)
    lines = log.splitlines()
    assert "Traceback" not in log and "without completing handshake" not in log, log[-3000:]
    assert max(len(line) for line in lines) < 1200, max(lines, key=len)[:300]
    assert "\x1b" not in log
    # 175 bad connections, 3-4 lines each unlimited; about 6 kinds of line, each rate-limited
    assert len(lines) <= 6 * (BURST + RATE_PER_S * elapsed_s) + 10 and len(log) < 60_000, (len(lines), elapsed_s)
    assert "suppressed" in log  # the rate limit says what it dropped
    hard.assert_no_leak()


# ----------------------------------------------------------------------------- 3 slow readers, drain


def test_client_that_never_reads_loses_its_slot_in_bounded_time(hard):
    """Defect 3: with pings off, a client that never reads held its slot forever. Now the slot comes
    back in bounded time, and since this client cannot take the error and close frames within the
    server's 1 s (CLOSE_TIMEOUT_S, docs/protocol.md), the TCP connection is dropped: it sees 1006, and
    the log says why. (A clean 1008 here would mean the drop never happened.)"""
    label = 'nemo_serve_stream_errors_total{reason="slow_client"}'
    before = hard.metric(label)
    start = len(hard.log())

    async def scenario():
        ws, sender = await never_reading_client(hard.port, hard.ws_url, 3000)
        freed_s = await seconds_until_slot_freed(hard, 30)
        assert freed_s < 30, f"slot still held after {freed_s:.0f} s"
        await asyncio.sleep(2 * CLOSE_TIMEOUT_S)  # the server's time to write its close has passed
        closed_s = await seconds_until_closed(ws, sender)  # now read: the server must have dropped the connection
        return freed_s, closed_s, ws.close_code

    freed_s, closed_s, code = asyncio.run(scenario())
    assert freed_s < 40, f"slot still held after {freed_s:.0f} s"
    assert hard.metric(label) == before + 1
    assert closed_s < 10 and code == 1006, (closed_s, code)
    assert "dropped: the client does not read" in _log_since(hard, start)
    hard.assert_no_leak()


def test_drain_sends_1012_and_exits_on_time_with_stalled_clients():
    """Defect 3: during a drain, a client that does not read pushed the exit to drain timeout
    + ~6 s. Two such clients: one starts reading just after the deadline and gets the
    documented error and 1012; the other never does and is dropped; the process exits 0.
    The clients run in a fresh process of their own (tests/drain_clients.py says why)."""
    env = {"NEMO_SERVE_PING_INTERVAL_S": "0", "NEMO_SERVE_SEND_TIMEOUT_S": "60"}
    # A server of its own, since SIGTERM ends it; to the supervisor only, which passes it on to its front end.
    with start_server("--num-slots", "2", "--drain-timeout-s", "2", "--log-level", "info", "--frontends", "1", env=env) as srv:
        exited_at: list[float] = []
        waiter = threading.Thread(target=lambda: (srv.proc.wait(120), exited_at.append(time.monotonic())), daemon=True)
        waiter.start()
        audio = srv.log_path.with_suffix(".speech.npy")
        np.save(audio, speech(6))
        cmd = [sys.executable, "-m", "tests.drain_clients", str(srv.port), srv.ws_url, str(srv.proc.pid), str(srv.log_path), str(audio)]
        child = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
        audio.unlink()
        waiter.join(40)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    server_lines = [ln for ln in srv.log().splitlines() if any(k in ln for k in ("drain", "dropped", "error"))]
    why = f"clients: {out['events']}; server: " + "\n".join(server_lines[-12:])
    assert exited_at, why
    exit_s = exited_at[0] - out["signalled_at"]
    assert srv.proc.returncode == 0, why
    assert exit_s < 2 + 3, f"exit {exit_s:.1f} s after SIGTERM with --drain-timeout-s 2; {why}"
    last = out["last"] or {}
    assert out["close_code"] == 1012 and last.get("type") == "error" and "drain" in last.get("reason", ""), (
        f"close {out['close_code']}, last {str(last)[:300]}; {why}")


# ----------------------------------------------------------------------------- 4 header timeout, caps


def _silent_for(port: int, payload: bytes) -> tuple[float, bytes]:
    """Seconds until the server closes a socket that sent `payload` and then nothing; its reply."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(payload)
        s.settimeout(6)
        t0 = time.monotonic()
        reply = b""
        try:
            while chunk := s.recv(4096):
                reply += chunk
        except (TimeoutError, ConnectionResetError):
            return (6.0 if not reply else time.monotonic() - t0), reply
        return time.monotonic() - t0, reply


def test_header_timeout_closes_silent_and_half_sent_requests(hard):
    """Defect 4: silent TCP sockets and half-sent requests stayed open (60 s and counting)."""
    # (a body that never comes is bounded by the same deadline)
    silent_s, _ = _silent_for(hard.port, b"")
    half_s, reply = _silent_for(hard.port, b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    # headers in time, an upload's body never comes (a route that reads its body: /healthz answered
    # 405 at once without reading it, so the deadline was never what closed it)
    body = (b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + TOKEN.encode() + b"\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000\r\n\r\n--b")  # fmt: skip
    body_s, body_reply = _silent_for(hard.port, body)
    assert silent_s < 3 and half_s < 3 and body_s < 3, (silent_s, half_s, body_s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
    assert body_reply.startswith(b"HTTP/1.1 408"), body_reply[:100]  # server.md: "also when the body ... stops"
    assert hard.get("/healthz").status_code == 200


def test_connection_caps_per_address_and_total(hard):
    """Defect 4: no cap; one address could hold every socket the server has."""
    from websockets.exceptions import InvalidStatus

    async def open_many(host: str, n: int) -> list:
        return [await ws_connect(hard.ws_url, local_addr=(host, 0)) for _ in range(n)]

    async def refused(host: str) -> InvalidStatus | None:
        try:
            ws = await ws_connect(hard.ws_url, local_addr=(host, 0))
        except InvalidStatus as e:
            return e
        await ws.close()
        return None

    async def scenario():
        held = await open_many("127.0.0.1", PER_IP)
        per_ip = await refused("127.0.0.1")
        other = await refused("127.0.0.2")  # another address still gets in
        held += await open_many("127.0.0.2", PER_IP) + await open_many("127.0.0.3", TOTAL - 2 * PER_IP)
        total = await refused("127.0.0.4")
        for ws in held:
            await ws.close()
        await asyncio.sleep(0.3)
        after = await refused("127.0.0.1")
        return per_ip, other, total, after

    per_ip, other, total, after = asyncio.run(scenario())
    assert per_ip is not None and per_ip.response.status_code == 503
    assert "connections from your address" in json.loads(per_ip.response.body)["reason"]
    assert other is None and after is None
    assert total is not None and total.response.status_code == 503
    assert "connections" in json.loads(total.response.body)["reason"]
    assert hard.metric('nemo_serve_refusals_total{reason="connection_limit"}') >= 2
    hard.assert_no_leak()


# ----------------------------------------------------------------------------- 5, 6 bad messages


@pytest.mark.parametrize("listener", LISTENERS)
def test_non_ascii_reason_closes_with_1008(hard, listener):
    """Defect 5: the close reason was cut to 120 characters, 200+ bytes: an abnormal close."""
    messages, code = asyncio.run(raw_session(hard.ws_base(listener) + "/ws", [json.dumps({"type": "é" * 100})]))
    assert messages[-1]["type"] == "error" and code == 1008, (messages, code)


@pytest.mark.parametrize("listener", LISTENERS)
def test_odd_json_types_get_1008_not_1011(hard, listener):
    """Defect 6: unhashable `type` values and integers past 4,300 digits raised inside the
    server: 1011 and a traceback."""
    frames = [
        '{"type": []}',
        '{"type": {}}',
        '{"type": "config", "sample_rate": ' + "9" * 5000 + "}",
        "1" * 4301,
    ]

    async def scenario():
        return [await raw_session(hard.ws_base(listener) + "/ws", [f]) for f in frames]

    for frame, (messages, code) in zip(frames, asyncio.run(scenario())):
        assert code == 1008 and messages[-1]["type"] == "error", (frame[:40], messages, code)
        assert len(messages[-1]["reason"]) < 300
    hard.assert_no_leak()


# ----------------------------------------------------------------------------- framing, a close among data


def _raw_frame(payload: bytes, opcode: int, fin: bool = True, rsv: int = 0) -> bytes:
    """A masked client frame with any FIN and reserved bits (websockets' client refuses to send these)."""
    f = bytearray(client_frame(payload, opcode))
    f[0] = (0x80 if fin else 0) | rsv | opcode
    return bytes(f)


_AUDIO = _raw_frame(np.zeros(1600, "<i2").tobytes(), 0x2)
FRAMING = {  # frames written after a config, in one write: (close code, reason) the client gets
    "continuation-first": ([_raw_frame(np.zeros(1600, "<i2").tobytes(), 0x0)], (1002, "unexpected continuation frame")),
    "data-frame-inside-a-fragmented-message": (
        [_raw_frame(b'{"type": ', 0x1, fin=False), _raw_frame(b'{"type": "end"}', 0x1)], (1002, "expected a continuation frame")),
    "reserved-bit": ([_raw_frame(np.zeros(1600, "<i2").tobytes(), 0x2, rsv=0x40)], (1002, "reserved bits must be 0")),
    "close-without-status": ([_raw_frame(b"", 0x8)], (1005, "")),
    "close-among-audio": ([_AUDIO] * 3 + [_raw_frame(struct.pack("!H", 1000), 0x8)] + [_AUDIO] * 2, (1000, "")),
}


@pytest.mark.parametrize("listener", LISTENERS)
def test_framing_errors_close_1002_and_a_close_among_data_frees_the_slot(hard, listener):
    """Frames that break RFC 6455 (a continuation with no message begun, a data frame inside a
    fragmented message, a reserved bit with no extension) close 1002 with websockets' reasons on
    both listeners (picows passed all three to the session: a stray continuation became a message
    of the type before it, a reserved bit was audio). A close with no status is answered with none
    (picows answered code 0, which no client accepts); a close in the same write as audio, with
    frames after it, frees the slot."""
    config = client_frame(json.dumps({"type": "config", "encoding": "pcm_s16le"}).encode(), 0x1)

    async def one(frames: list[bytes]) -> tuple[int | None, str]:
        await asyncio.to_thread(hard.assert_no_leak)  # the last case's slot comes back a moment after its close
        async with ws_connect(hard.ws_base(listener) + "/ws") as ws:
            ws.transport.write(config + b"".join(frames))
            try:
                await messages_until_close(ws, 5)
            except TimeoutError:
                return None, "no close in 5 s"
            return ws.close_code, ws.close_reason

    async def scenario():
        return [await one(frames) for frames, _ in FRAMING.values()]

    got = dict(zip(FRAMING, asyncio.run(scenario())))
    assert got == {name: expected for name, (_, expected) in FRAMING.items()}, got
    hard.assert_no_leak()


def _flood_without_reading(s: socket.socket, burst: bytes, pgid: int) -> tuple[int, float]:
    """`burst` sent again and again for 2 s, nothing read: (bytes sent, MB the server grew by)."""
    before = _group_rss_mb(pgid)
    s.settimeout(0.5)
    sent, t0 = 0, time.monotonic()
    try:
        while time.monotonic() - t0 < 2:
            s.sendall(burst)
            sent += len(burst)
    except TimeoutError:
        pass  # the server stopped reading: the flood stalls
    return sent, _group_rss_mb(pgid) - before


def _group_rss_mb(pgid: int) -> float:
    """The resident memory of every process of the server (its process group: start_server's session)."""
    total_kib = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # pgrp, the fifth field of /proc/PID/stat
                status = (stat.parent / "status").read_text()
                total_kib += int(status.split("VmRSS:", 1)[1].split()[0])
        except (OSError, IndexError, ValueError):
            pass  # a process that ended meanwhile
    return total_kib / 1024


@pytest.mark.parametrize("listener", LISTENERS)
def test_ping_flood_from_a_client_that_never_reads_is_bounded(hard, listener):
    """A client that sends pings as fast as it can and never reads its pongs: the pongs piled up in
    the transport's buffer, 1.6 GB in 2 s through picows (its auto-pong answered every ping), 75 MB
    through uvicorn. Now both listeners answer a ping only while writes are not paused (RFC 6455
    lets an endpoint answer only the latest ping) and go on reading (a close is heard at once):
    the server grows by a few MB at most."""
    with raw_upgrade(hard.ws_port(listener), "/ws", timeout_s=5, rcvbuf=4096) as s:
        sent, grown = _flood_without_reading(s, _raw_frame(b"p" * 125, 0x9) * 512, hard.proc.pid)
    assert grown < 40, f"{listener}: {sent >> 20} MB of pings grew the server by {grown:.0f} MB"
    hard.assert_no_leak()


def test_pipelined_requests_from_a_client_that_never_reads_are_bounded(hard):
    """Pipelined `GET /readyz` sent as fast as a client could, its answers never read: uvicorn parsed
    every read whole and queued each request in it, resuming reading at each answer, so the server
    grew by 720 MB in 3 s (440 MB with /metrics). Now a read is parsed a slice at a time and the rest
    held, reading paused, while a request waits for the one before it (uvicorn_protocols._feed).
    A client that reads gets every pipelined answer, in order; one that leaves while an answer is
    stalled ends that answer without a traceback (the fixture's check)."""
    request = f"GET /readyz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(("127.0.0.1", hard.port))
        sent, grown = _flood_without_reading(s, request * 4096, hard.proc.pid)
    assert grown < 40, f"{sent >> 20} MB of pipelined requests grew the server by {grown:.0f} MB"
    with socket.create_connection(("127.0.0.1", hard.port), timeout=10) as s:  # a client that reads
        n = 300  # several slices' worth, and a /healthz among them
        s.sendall(request * (n // 2) + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + request * (n // 2 - 1))
        answers = b""
        while answers.count(b"HTTP/1.1 200") < n:
            chunk = s.recv(1 << 16)
            assert chunk, f"closed after {answers.count(b'HTTP/1.1 200')} of {n} answers"
            answers += chunk
    bodies = answers.split(b"HTTP/1.1 200")[1:]
    assert len(bodies) == n and b'"status":"ok"' in bodies[n // 2] and b'"ready"' in bodies[n // 2 + 1]
    hard.assert_no_leak()


def test_a_pipelined_request_that_stalls_behind_a_slow_answer_gets_its_408_after_that_answer(hard):
    """A file transcription (several seconds of work) and, pipelined behind it, a request cut off
    mid-headers: the cut request's 1 s deadline fell while the file was still being transcribed, and
    its 408 went out first, so the client read it as the file's answer (the file's 200 was dropped).
    Now a pipelined request's deadline waits for the answer before it: the file's whole 200, then the
    408, then the close. Seen failing without that wait (the first bytes were the 408)."""
    audio = (np.tile(speech(12), 10) * 32767).astype("<i2")  # about 6 minutes: seconds of work on this toy model
    body = multipart({"file": ("a.wav", wav_bytes(audio), "audio/wav")})
    with socket.create_connection(("127.0.0.1", hard.port), timeout=60) as s:
        t0 = time.monotonic()
        s.sendall(upload_head(len(body)) + body + b"GET /readyz HTTP/1.1\r\nHo")
        got, first_s = b"", None
        while chunk := s.recv(1 << 16):
            first_s = time.monotonic() - t0 if first_s is None else first_s
            got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert first_s > 1.5, f"the file's answer took {first_s:.2f} s: the 1 s deadline never fell during it"
    answer, _, rest = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in answer.split(b"\r\n") if line.lower().startswith(b"content-length")))
    assert b'"text"' in rest[:length] and rest[length:].startswith(b"HTTP/1.1 408"), got[-300:]
    hard.assert_no_leak()


# ----------------------------------------------------------------------------- 7 long segments


def _assemble(partials: list[dict]) -> list[tuple[list[int], str]]:
    """What a client holds after each partial: a partial replaces the segment from its offsets on."""
    ids: list[int] = []
    text = ""
    held = []
    for m in partials:
        ids = ids[: m.get("token_offset", 0)] + m["token_ids"]
        text = text[: m.get("text_offset", 0)] + m["text"]
        held.append((ids, text))
    return held


def test_partials_stay_bounded_on_a_long_segment(hard):
    """Defect 7: with endpointing off every partial carried the whole segment (quadratic)."""
    audio = speech(30)  # ~90 s of speech in one segment, ~570 tokens

    async def scenario():
        out = []
        async with ws_connect(hard.ws_url) as ws:
            await ws.send(json.dumps({"type": "config", "endpointing": {"enabled": False}}))

            async def send():
                for i in range(0, len(audio), 16000):
                    await ws.send(audio[i : i + 16000].tobytes())
                await ws.send(json.dumps({"type": "end"}))  # "Done" would add the bare text "Done!"

            sender = asyncio.create_task(send())
            async for m in ws:
                out.append((len(m), json.loads(m)))
            await sender
        return out

    out = asyncio.run(scenario())
    partials = [m for _, m in out if m["type"] == "partial"]
    finals = [m for _, m in out if m["type"] == "final"]
    assert len(finals) == 1 and out[-1][1]["type"] == "done"
    final = finals[0]
    assert len(final["token_ids"]) > 500
    assert final["token_ids"] == oracle_transcribe(helpers.model(TEST_MODEL), audio).token_ids
    assert max(n for n, m in out if m["type"] == "partial") < 6000  # bounded, whatever the length
    for ids, text in _assemble(partials):  # what the client holds is always the final's prefix
        assert final["token_ids"][: len(ids)] == ids
        assert final["text"].startswith(text)
    assert len(_assemble(partials)[-1][0]) > 400
    hard.assert_no_leak()


# ----------------------------------------------------------------------------- 8 origin


def test_origin_allow_list(hard):
    """Defect 8: any web page could drive the server (no token needed on a local one)."""
    from websockets.exceptions import InvalidStatus

    async def status(origin: str | None) -> int:
        try:
            async with ws_connect(hard.ws_url, origin=origin) as ws:
                await ws.send("Done")
                await ws.wait_closed()
                return 101
        except InvalidStatus as e:
            return e.response.status_code

    async def scenario():
        return [
            await status(o)
            for o in (None, f"http://127.0.0.1:{hard.port}", "https://app.example.com", "https://evil.example", "null")
        ]

    assert asyncio.run(scenario()) == [101, 101, 101, 403, 403]
    assert hard.metric('nemo_serve_refusals_total{reason="origin"}') == 2
    hard.assert_no_leak()


# ----------------------------------------------------------------------------- 9 start-up errors


def test_tls_start_up_errors_are_one_line_exit_2(tmp_path):
    """Defect 9: a certificate that is not PEM gave a traceback and exit 1; a missing TLS file
    was blamed on `--settings`, which does not exist."""
    from nemo_serve import cli
    from nemo_serve.config import Settings, SettingsError

    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a not a PEM certificate")
    out = subprocess.run(
        [sys.executable, "-m", "nemo_serve.cli", "--model", TEST_MODEL, "--port", "0", "--ssl-certfile", str(not_pem)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("nemo-serve: error: --ssl-certfile") and "PEM" in lines[0]
    with pytest.raises(SettingsError) as missing:
        Settings.from_sources({"ssl_certfile": str(not_pem), "ssl_keyfile": str(tmp_path / "nope.pem")}, {})
    assert str(missing.value).startswith("--ssl-keyfile") and "--settings" not in str(missing.value)
    with pytest.raises(SettingsError) as alone:
        Settings.from_sources({"ssl_keyfile": str(not_pem)}, {})
    assert "--ssl-keyfile" in str(alone.value) and "--ssl-certfile" in str(alone.value)
    assert "--settings" not in str(alone.value)
    assert cli.main(["--ssl-keyfile", str(not_pem)]) == 2


# ----------------------------------------------------------------------------- fuzz


@pytest.mark.parametrize("listener", LISTENERS)
def test_hostile_input_fuzz_small(hard, listener):
    """A few hundred fuzzed frames on each listener (benchmarks/fuzz_server.py runs the long version)."""
    start = len(hard.log())
    stats = asyncio.run(fuzz(hard.ws_base(listener) + "/ws", 300, seed=14, token=TOKEN, concurrency=2))
    assert stats.messages >= 300 and stats.cases >= 50
    assert stats.crashes == 0 and stats.abnormal == 0 and stats.hangs == 0, stats.as_dict()
    assert not stats.client_errors, stats.as_dict()
    assert stats.closes[1008] > 10 and stats.max_reply_bytes < 4096, stats.as_dict()
    log = _log_since(hard, start)
    assert "Traceback" not in log and len(log) < 60_000, log[-3000:]
    assert hard.get("/healthz").status_code == 200
    hard.assert_no_leak()


def test_performance_docs_have_the_fuzz_figures():
    """The figures sit in the generated fuzz table (tests/test_docs.py checks it equals its result files)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "performance.md").read_text()
    section = text.split("## Hostile input", 1)[1].split("\n## ", 1)[0]
    assert "<!-- table: fuzz -->" in section and "fuzz_server_tiny-hybrid.json" in section
    for words in ("slots leaked", "RSS", "drain", "benchmarks/fuzz_server.py"):
        assert words in section, words
