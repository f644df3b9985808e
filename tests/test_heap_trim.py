"""A front end hands glibc's free heap back to the OS (nemo_serve/server/heap_trim.py): RSS falls
after the trim on a heap fragmented on purpose, the trim waits for a quiet loop, and where the C
library has no malloc_trim (musl, macOS) the task is a no-op said once at debug."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_serve.config import Settings
from nemo_serve.server import heap_trim

from .helpers_draining_server import draining_server

ROOT = Path(__file__).resolve().parent.parent

# In a fresh process: 64 MiB of 1 KiB bytes objects (glibc's heap, not pymalloc's), all but one in
# 16 freed. free() keeps those pages (a live block pins each run); malloc_trim(0) releases them.
FRAGMENT_THEN_TRIM = """
import json, sys
from nemo_serve.server.heap_trim import load_malloc_trim

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

trim = load_malloc_trim()
blocks = [bytes(1024) for _ in range(64 * 1024)]
blocks = blocks[::16]
before = rss_mib()
if trim is not None and sys.argv[1] == "trim":
    trim()
print(json.dumps({"before": before, "after": rss_mib(), "has_trim": trim is not None}))
"""


def _fragmented_heap_rss(action: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", FRAGMENT_THEN_TRIM, action], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_returns_a_fragmented_heap_to_the_os():
    trimmed = _fragmented_heap_rss("trim")
    if not trimmed["has_trim"]:
        pytest.skip("this Linux C library has no malloc_trim (musl)")
    untouched = _fragmented_heap_rss("none")
    # ~60 MiB freed in both; only the trim gives it back
    assert trimmed["before"] - trimmed["after"] > 30, trimmed
    assert untouched["before"] - untouched["after"] < 5, untouched


class _Libc:
    """What ctypes.CDLL(None) gives: with or without malloc_trim."""

    def __init__(self, has_trim: bool) -> None:
        self.calls = 0
        if has_trim:
            def malloc_trim(pad: int) -> int:
                self.calls += 1
                return 1

            self.malloc_trim = malloc_trim

    def loader(self, name):
        assert name is None  # the process's own symbols
        return self


def test_without_malloc_trim_the_task_is_a_no_op_said_once_at_debug(caplog):
    libc = _Libc(has_trim=False)
    with caplog.at_level(logging.DEBUG, logger="nemo_serve.server"):
        asyncio.run(asyncio.wait_for(heap_trim.trim_periodically(0.01, libc.loader), 5))  # returns, never loops
    said = [r for r in caplog.records if "no malloc_trim" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG


def test_with_malloc_trim_the_task_trims_every_period_until_cancelled():
    libc = _Libc(has_trim=True)

    async def run_for(seconds: float) -> None:
        task = asyncio.ensure_future(heap_trim.trim_periodically(0.05, libc.loader))
        await asyncio.sleep(seconds)
        task.cancel()

    asyncio.run(run_for(1.5))
    assert libc.calls >= 3, libc.calls  # each period: 0.05 s, then a quiet 0.05 s probe
    assert asyncio.run(asyncio.wait_for(heap_trim.trim_periodically(0, libc.loader), 5)) is None  # 0: off


def test_a_busy_loop_is_not_trimmed_until_it_is_quiet():
    async def busy_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.02)  # a callback that holds the loop, as a burst of packets would
            await asyncio.sleep(0)

    libc = _Libc(has_trim=True)

    async def probe_while_busy() -> tuple[bool, bool, int]:
        trimming = asyncio.ensure_future(heap_trim.trim_periodically(0.05, libc.loader))
        hog = asyncio.ensure_future(busy_for(2.0))
        busy = await heap_trim.wait_until_idle(probe_s=0.01, max_tries=5)
        await hog
        calls_while_busy = libc.calls  # the periodic task's own probes saw the busy loop too
        quiet = await heap_trim.wait_until_idle(probe_s=0.01, max_tries=50)
        for _ in range(100):  # then it trims at the first quiet moment
            if libc.calls:
                break
            await asyncio.sleep(0.01)
        trimming.cancel()
        return busy, quiet, calls_while_busy

    assert asyncio.run(probe_while_busy()) == (False, True, 0)
    assert libc.calls >= 1


def test_the_setting_defaults_on_and_turns_off_from_flag_or_environment():
    assert Settings().heap_trim_period_s == 60.0
    assert Settings.from_sources({}, {"NEMO_SERVE_HEAP_TRIM_PERIOD_S": "0"}).heap_trim_period_s == 0
    assert Settings.from_sources({"heap_trim_period_s": 30.0}, {}).heap_trim_period_s == 30.0


def test_a_serving_front_end_runs_the_trim_task():
    with draining_server(heap_trim_period_s=30.0) as server:
        task = server._heap_trim_task
        assert task is not None and not task.done()
    assert task.done()  # cancelled by shutdown() (or by asyncio.run, at the latest)


def test_the_setting_reaches_the_front_ends_server(monkeypatch):
    """--heap-trim-period-s (Settings) is what server/runner.serve hands its DrainingServer, whose
    start-up turns it into the task above: without that line every front end ran the class default
    (0: no trim) whatever the flag said, and no test saw it (the one above sets the attribute itself)."""
    import types

    from nemo_serve.server import runner

    served = []
    monkeypatch.setattr(runner.DrainingServer, "run", lambda self, sockets=None: served.append(self))
    monkeypatch.setattr(runner.logsafe, "install", lambda secrets: None)  # no process-wide log filters here
    frontend = types.SimpleNamespace(app=lambda scope, receive, send: None, limiter=None, header_timeout_s=1.0,
                                     ctx=types.SimpleNamespace(settings=types.SimpleNamespace(grpc_port=None, fast_grpc_port=None)))  # fmt: skip
    for period_s in (17.0, 0.0):
        runner.serve(frontend, Settings.from_sources({"heap_trim_period_s": period_s}, {}), sock=None)
    assert [s.heap_trim_period_s for s in served] == [17.0, 0.0]
