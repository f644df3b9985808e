"""The two stalled clients of test_hardening's drain test, in a process of their own.

The client that resumes after the drain deadline has the server's 1 s close grace to read its
backlog, error and close frame. In the pytest process, after hundreds of tests, one pass of
Python's cyclic collector over the heap they left can take longer than that (a 10-million-object
heap: 3 s in one pass on this machine), so the client's timing depended on which tests ran before
it: 1006 in 4 of 8 full runs, never alone. A fresh interpreter has a small heap, as a real client
does (it imports no NeMo: the audio it loops comes in a .npy file). Run as
`python -m tests.drain_clients PORT WS_URL SERVER_PID LOG_PATH AUDIO_NPY`; prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from .helpers_ws import never_reading_client


async def scenario(port: int, ws_url: str, server_pid: int, log_path: Path, audio: np.ndarray) -> dict:
    from websockets.exceptions import ConnectionClosed

    events: list = []
    a, a_send = await never_reading_client(port, ws_url, 400, audio)
    b, b_send = await never_reading_client(port, ws_url, 400, audio)
    await asyncio.wait({a_send, b_send}, timeout=30)  # every frame taken: the model is on it
    events.append(("senders done", a_send.done(), b_send.done()))
    await asyncio.sleep(3.0)  # results pile up behind the full socket buffers
    signalled_at = time.monotonic()  # CLOCK_MONOTONIC: the same clock as the parent's
    os.kill(server_pid, signal.SIGTERM)
    # Just past the 2 s deadline, inside the 1 s the close frames get: timed from the front end's
    # own line for the deadline's failures, not from the signal plus 2 s (a sleep's late wake-up on
    # a loaded machine would add to the delay).
    while "error (drain_timeout)" not in log_path.read_text(errors="replace"):
        await asyncio.sleep(0.01)
    events.append(("deadline line seen", round(time.monotonic() - signalled_at, 3)))
    a.transport.resume_reading()
    last, count = None, 0
    try:
        async with asyncio.timeout(20):
            async for m in a:
                last, count = json.loads(m), count + 1
    except ConnectionClosed:  # 1012 is not a normal close; the parent checks the code
        pass
    events.append(("closed", round(time.monotonic() - signalled_at, 3), count))
    b.transport.abort()
    return {"signalled_at": signalled_at, "close_code": a.close_code, "last": last, "events": events}


if __name__ == "__main__":
    port, url, pid, log, audio = sys.argv[1:6]
    print(json.dumps(asyncio.run(scenario(int(port), url, int(pid), Path(log), np.load(audio)))), flush=True)
