"""Riva tests' server, utterances and /ws reference finals for the same wav (test_riva_grpc.py,
test_riva_framework_requests.py)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import soundfile

import nemo_serve
from nemo_serve.client import StreamingClient

from .helpers_server import TOKEN, free_port, start_shared, stop_shared


UTTERANCES = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))
RIVA_NUM_SLOTS = 2


@pytest.fixture(scope="session")
def riva_server():
    """One --grpc-port server for both Riva test files (adjacent in a run; registered in conftest.py):
    each started its own, a server start (NeMo's import in the engine core) apiece. Every trained
    mode (the first, 1120 ms, stays the default), a 3 s idle timeout (test_riva_grpc.py's silent
    call), and --fast-grpc-port too where hpack is installed (test_riva_grpc.py's fast door)."""
    grpc_port, fast_port = free_port(), free_port() if importlib.util.find_spec("hpack") else None
    fast = ("--fast-grpc-port", str(fast_port)) if fast_port else ()
    s = start_shared("riva_server", "--grpc-port", str(grpc_port), *fast, "--num-slots", str(RIVA_NUM_SLOTS),
                     "--context-right", "all", "--idle-timeout-s", "3")  # fmt: skip
    s.grpc_port, s.fast_grpc_port = grpc_port, fast_port
    yield s
    stop_shared("riva_server")


def ws_finals(server, wav: Path, context_right: int | None = None, endpointing: dict | None = None,
              phrases: list[str] | None = None, boost: float | None = None) -> list[dict]:  # fmt: skip
    """/ws's non-empty finals for the same samples (PCM16 at the file's rate, 100 ms packets)."""
    samples, rate = soundfile.read(wav, dtype="int16")
    return ws_finals_of(server, samples, rate, context_right, endpointing, phrases, boost)


def ws_finals_of(server, samples: np.ndarray, rate: int, context_right: int | None = None, endpointing: dict | None = None,
                 phrases: list[str] | None = None, boost: float | None = None) -> list[dict]:  # fmt: skip
    async def run() -> list[dict]:
        async with StreamingClient(server.ws_url, sample_rate=rate, encoding="pcm_s16le", token=TOKEN,
                                   context_right=context_right, endpointing=endpointing, phrases=phrases,
                                   boost=boost, ssl_context=server.ssl_context) as c:  # fmt: skip
            for i in range(0, len(samples), rate // 10):
                await c.send_audio(samples[i : i + rate // 10])
            await c.end()
            return [m async for m in c.messages() if m["type"] == "final" and m["text"]]

    return asyncio.run(run())


def ws_text(server, wav: Path, **options) -> list[str]:
    return [f["text"] for f in ws_finals(server, wav, **options)]
