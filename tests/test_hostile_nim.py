"""NIM's front door under hostile clients (issue 45), as tests/test_hardening.py holds /ws: the
session POST (`/v1/realtime/transcription_sessions`) with scripted bad bodies and a seeded fuzz,
churn on the NIM websocket session, a neighbour stream compared token for token, slots and RSS
checked after. Its own server (info-level log, no traceback allowed in it), raw sockets and httpx.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from .helpers_server import TOKEN, start_server

SESSIONS = "/v1/realtime/transcription_sessions"
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def nim():
    with start_server("--num-slots", "3", "--idle-timeout-s", "20", "--log-level", "info") as s:
        yield s
    assert "Traceback" not in s.log(), s.log()[-4000:]


def tree_rss_mb(pid: int) -> float:
    """Resident memory of the server's process group (front ends and engine cores)."""
    total_kib = 0
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getpgid(int(proc.name)) != pid:
                continue
            status = (proc / "status").read_text()
        except (OSError, ProcessLookupError):
            continue
        total_kib += next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), 0)
    return total_kib / 1024


def post(server, body: bytes, headers: dict | None = None) -> httpx.Response:
    headers = {**server.auth_headers, "Content-Type": "application/json", **(headers or {})}
    return httpx.post(server.http_url + SESSIONS, content=body, headers=headers, trust_env=False, timeout=10)


def stream_post(port: int, head: str, chunks, limit_s: float = 20.0) -> tuple[int | None, float, int]:
    """POST on a raw socket, sending `chunks` until the server answers: (status, seconds to the
    answer, body bytes sent by then). A server that reads the whole body answers only at its end."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=limit_s)
    t0, sent, reply = time.monotonic(), 0, b""
    try:
        sock.sendall(head.encode())
        sock.setblocking(False)
        for chunk in chunks:
            if time.monotonic() - t0 > limit_s:
                break
            try:
                reply += sock.recv(65536)
                if reply:
                    break
            except BlockingIOError:
                pass
            view = memoryview(chunk)
            while view and time.monotonic() - t0 < limit_s:
                try:
                    n = sock.send(view)
                    view, sent = view[n:], sent + n
                except BlockingIOError:
                    try:
                        reply += sock.recv(65536)
                    except BlockingIOError:
                        time.sleep(0.001)
                        continue
                    if reply:
                        break
            if reply:
                break
        else:
            sock.setblocking(True)
            reply += sock.recv(65536)
    except (BrokenPipeError, ConnectionResetError):
        sock.setblocking(True)
        try:
            reply += sock.recv(65536)
        except OSError:
            pass
    finally:
        elapsed = time.monotonic() - t0
        sock.close()
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else None
    return status, elapsed, sent


def _head(extra: str) -> str:
    return (f"POST {SESSIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n")  # fmt: skip


# ----------------------------------------------------------------------------- defect 5: size


def test_a_200_mb_body_is_refused_from_its_content_length_at_once_without_memory(nim):
    """Before: the whole body was read, then 413 (5.4 s, +195 MB)."""
    rss0 = tree_rss_mb(nim.proc.pid)
    megabyte = b"[" * (1 << 20)
    status, elapsed, sent = stream_post(nim.port, _head(f"Content-Length: {200 << 20}\r\n"), [megabyte] * 200)
    assert status == 413 and elapsed < 2.0, (status, elapsed, sent)
    assert sent < 50 << 20 and tree_rss_mb(nim.proc.pid) - rss0 < 20, (sent, rss0, tree_rss_mb(nim.proc.pid))


def test_a_chunked_body_is_refused_once_it_passes_the_cap_and_never_read_further(nim):
    rss0 = tree_rss_mb(nim.proc.pid)
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"{" * (1 << 20))
    status, elapsed, sent = stream_post(nim.port, _head("Transfer-Encoding: chunked\r\n"), [chunk] * 200)
    assert status == 413 and elapsed < 2.0, (status, elapsed, sent)
    assert sent < 50 << 20 and tree_rss_mb(nim.proc.pid) - rss0 < 20, (sent, rss0, tree_rss_mb(nim.proc.pid))
    r = post(nim, b" " * (MAX_BODY_BYTES + 1))
    assert r.status_code == 413 and r.json()["error"]["message"] == f"session body is over {MAX_BODY_BYTES} bytes"
    assert post(nim, b" " * MAX_BODY_BYTES).status_code == 200


# ----------------------------------------------------------------------------- defect 5: nesting


@pytest.mark.parametrize("body", [b"[" * 40_000, b'{"a":' * 10_000, b"[" * 33 + b"]" * 33,
                                  b'{"session": ' + b'{"x": [' * 20 + b"1" + b"]}" * 20 + b"}"])  # fmt: skip
def test_deep_nesting_under_the_size_cap_is_a_400_that_says_so(nim, body):
    """Before: RecursionError inside json.loads, answered 500."""
    r = post(nim, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["message"] == "the body nests arrays and objects more than 32 levels deep"


def test_nesting_inside_strings_does_not_count(nim):
    assert post(nim, json.dumps({"prompt": "[" * 40_000, "x": [[[["]]]]"]]]]}).encode()).status_code == 200
