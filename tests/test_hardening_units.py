"""The front door's hardening pieces, in process (issue 14; the real server's tests are in
test_hardening.py): close reasons cut on a character boundary, the log filter, the connection cap
under the open-file limit, same-origin on a loopback server, the outbox and the partial tail."""

from __future__ import annotations

import asyncio
import sys
import time


def test_close_reason_is_cut_by_bytes_on_a_character_boundary():
    from nemo_serve.server.protocol import close_reason

    for text in ("é" * 100, "€" * 60, "a" + "😀" * 40, "plain ascii " * 20):
        cut = close_reason(text)
        assert len(cut.encode()) <= 123 and text.startswith(cut) and len(cut.encode()) > 119


def test_log_filter_redacts_escapes_cuts_and_rate_limits():
    import logging

    from nemo_serve.server.logsafe import BURST, SafeLogFilter

    f = SafeLogFilter(secrets=("s3cret",))

    def record(msg, *args, name="nemo_serve.session", exc_info=None):
        return logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, exc_info)

    r = record('%s - "WebSocket %s" [accepted]', "1.2.3.4:5", "/ws?a=1&token=s3cret&b=2")
    assert f.filter(r) and r.getMessage() == '1.2.3.4:5 - "WebSocket /ws?a=1&token=<redacted>&b=2" [accepted]'
    r = record("error: %s", "x" * 100_000 + "\n2026 forged line \x1b[31m s3cret")
    assert f.filter(r) and len(r.getMessage()) < 1100 and "\n" not in r.getMessage()
    r = record("tail: %s", "\n2026 forged line \x1b[31m s3cret")
    assert f.filter(r) and "\x1b" not in r.getMessage() and "s3cret" not in r.getMessage()
    access = record('%s - "%s %s HTTP/%s" %d', "1.2.3.4:5", "GET", "/readyz?token=s3cret", "1.1", 200, name="uvicorn.access")
    assert f.filter(access) and len(access.args) == 5 and "s3cret" not in access.args[2]  # uvicorn reads the args
    try:
        b"\xff".decode()
    except UnicodeDecodeError:  # what uvicorn logs with its traceback
        utf8 = record("Invalid UTF-8 sequence received from client.", name="uvicorn.error", exc_info=sys.exc_info())
    assert f.filter(utf8) and utf8.exc_info is None and utf8.levelno == logging.INFO
    kept = sum(f.filter(record("ws%d error: %s", i, "bad")) for i in range(10 * BURST))
    assert BURST <= kept <= BURST + 2
    time.sleep(1.1)
    again = record("ws%d error: %s", 0, "bad")
    assert f.filter(again) and "similar lines suppressed" in again.getMessage()


def test_connection_cap_stays_under_the_open_file_limit():
    from nemo_serve.server.connections import FILE_RESERVE, max_connections_for

    assert max_connections_for(1024, None) == 1024
    assert max_connections_for(1024, 256) == 256 - FILE_RESERVE  # refuse before accept() hits EMFILE
    assert max_connections_for(100, 1 << 20) == 100


def test_same_origin_needs_a_loopback_host_on_a_loopback_server():
    """A page on an attacker's domain re-pointed at 127.0.0.1 (DNS rebinding) is same-origin
    with itself; on a server bound to loopback the Host must be a loopback name too."""
    from types import SimpleNamespace

    from nemo_serve.server.app import _origin_refusal

    def ws(origin, host):
        return SimpleNamespace(headers={"origin": origin, "host": host})

    rebinding = ws("http://evil.example:8000", "evil.example:8000")
    assert _origin_refusal(rebinding, frozenset(), loopback_only=True) is not None
    assert _origin_refusal(rebinding, frozenset(), loopback_only=False) is None  # --host 0.0.0.0: its own page
    for origin, host in (("http://localhost:8000", "localhost:8000"), ("https://[::1]", "[::1]:443"),
                         ("http://127.0.0.1", "127.0.0.1:80")):  # fmt: skip
        assert _origin_refusal(ws(origin, host), frozenset(), loopback_only=True) is None, origin
    assert _origin_refusal(ws("http://127.0.0.1:9000", "127.0.0.1:8000"), frozenset(), True) is not None
    assert _origin_refusal(ws("http://a.example:x", "a.example"), frozenset(), False) is not None  # bad port
    assert _origin_refusal(ws("https://app.example.com", "h:1"), frozenset({"https://app.example.com"}), True) is None


def _result(segment: int, ids: list[int], is_final: bool = False):
    from nemo_serve.engine.results import StreamResult

    text = "".join(chr(ord("a") + i % 26) for i in ids)
    return StreamResult("s", text, segment, is_final, [], ids, [0.0] * len(ids), 0.0, 0.0, 0.0, done=False)


def test_outbox_coalesces_partials_then_refuses():
    from nemo_serve.server.outbox import Outbox

    box = Outbox(max_queued=3)
    assert box.put(_result(0, [1])) and box.put(_result(0, [1, 2]))  # the second replaces the first
    assert len(box) == 1 and box.num_coalesced == 1
    assert box.put(_result(0, [1, 2, 3], is_final=True)) and box.put(_result(1, [4]))
    assert not box.put(_result(2, [5], is_final=True))  # full: the session closes the stream
    box.put_first("close")
    assert len(box) == 1 and asyncio.run(box.get()) == "close"


def test_partial_tail_offsets_rebuild_the_segment():
    from nemo_serve.server.outbox import PartialTail

    tail = PartialTail(whole_max_tokens=4)
    held_ids: list[int] = []
    for n in range(1, 12):
        r = _result(0, list(range(n)))
        tok, txt = tail.offsets(r)
        assert (tok, txt) == ((0, 0) if n <= 4 else (n - 1, n - 1))
        held_ids = held_ids[:tok] + r.token_ids[tok:]
        assert held_ids == r.token_ids
    assert tail.offsets(_result(0, list(range(12)), is_final=True)) == (0, 0)
    assert tail.offsets(_result(1, [1])) == (0, 0)
