"""End-to-end test helpers: the real `nemo-serve` process on a free port, and small clients.

`start_server` starts the installed console script in its own process group, waits for
/readyz, and kills the group in `finally:` whatever happens. `ServerProcess.assert_no_leak`
is the "engine is empty" check: every slot free again, no stream open.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

# The committed default is a built-in; NEMO_SERVE_TEST_MODEL points the tests at another model.
TEST_MODEL = os.environ.get("NEMO_SERVE_TEST_MODEL", "builtin:tiny-hybrid")
PROMPT_TEST_MODEL = os.environ.get("NEMO_SERVE_TEST_PROMPT_MODEL", "builtin:tiny-prompt")  # has language prompts
TOKEN = "e2e-secret-token"
STARTUP_TIMEOUT_S = float(os.environ.get("NEMO_SERVE_TEST_STARTUP_S", "600"))  # NeMo import + model build on 2 busy cores


# The WebSocket listeners a hostile suite runs against, on one server started with fast_ws=True:
# uvicorn (--port) and picows (--fast-ws-port; skipped where the optional picows is not installed).
LISTENERS = [
    "uvicorn",
    pytest.param("picows", marks=pytest.mark.skipif(importlib.util.find_spec("picows") is None, reason="no picows")),
]


# The shared server (e2e and browser tests): small limits so that the limit tests are quick.
SHARED_NUM_SLOTS = 3
# Every trained mode (the first, 1120 ms, stays the default): the latency-mode tests choose others.
SHARED_ARGS = ("--num-slots", str(SHARED_NUM_SLOTS), "--idle-timeout-s", "5", "--max-stream-s", "10", "--context-right", "all")


@pytest.fixture(scope="session")
def shared_server():
    """One server for every test that does not end it: starting one costs NeMo's import and
    the model build (~30 s on two busy cores). Registered in conftest.py."""
    with start_server(*SHARED_ARGS) as s:
        yield s


# Servers that a few files share (the session fixtures below and helpers_riva.riva_server) stop
# after the last test that asks for them, not at the session's end: each holds about 1 GB (engine
# core, front end) that later files may need. conftest.py's teardown hook calls release_after.
_SHARED_STACKS: dict[str, contextlib.ExitStack] = {}


def start_shared(fixture_name: str, *args: str, **kwargs) -> "ServerProcess":
    """start_server(*args, **kwargs) for the session fixture `fixture_name`, stopped by release_after."""
    stack = contextlib.ExitStack()
    _SHARED_STACKS[fixture_name] = stack
    return stack.enter_context(start_server(*args, **kwargs))


def stop_shared(fixture_name: str) -> None:
    """Stop it now if it still runs (a session fixture's teardown: the session ended first)."""
    stack = _SHARED_STACKS.pop(fixture_name, None)
    if stack is not None:
        stack.close()


def release_after(item) -> None:
    """After `item`'s teardown: stop each shared server that no later test of the session asks for."""
    if not _SHARED_STACKS:
        return
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    for name in list(_SHARED_STACKS):
        if not any(name in it.fixturenames for it in later):
            stop_shared(name)


@pytest.fixture(scope="session")
def diarizing_server():
    """One server with the toy diarizer and a --grpc-port for test_diarization_protocols.py and
    test_diarization_server.py (each started its own: a server start apiece, mostly NeMo's import in
    the engine core). Four slots: test_diarization_server.py opens four streams at once.
    Registered in conftest.py."""
    grpc_port = free_port()
    s = start_shared("diarizing_server", "--grpc-port", str(grpc_port), "--num-slots", "4",
                     "--diarizer", "builtin:tiny-sortformer")  # fmt: skip
    s.grpc_port = grpc_port
    yield s
    stop_shared("diarizing_server")


@pytest.fixture(scope="session")
def demo_pair_server():
    """The demo model on two slots, default settings otherwise, for the NVIDIA realtime client's
    runs in test_forced_ends_after_endpoint.py (one stream; it started its own on one slot) and
    test_nim_sessions.py (two at once; its own on two slots). Registered in conftest.py."""
    from nemo_serve.model import DEMO_MODEL_PATH

    yield start_shared("demo_pair_server", "--num-slots", "2", model=str(DEMO_MODEL_PATH))
    stop_shared("demo_pair_server")


# Deepgram's /v1/listen (tests/test_deepgram.py and test_hostile_deepgram.py): both listeners, 3
# slots, pings off and a 2 s send timeout (the hostile suite's slow readers), a debug-level log.
DEEPGRAM_NUM_SLOTS = 3
DEEPGRAM_ENV = {"NEMO_SERVE_PING_INTERVAL_S": "0", "NEMO_SERVE_SEND_TIMEOUT_S": "2"}


@pytest.fixture(scope="session")
def deepgram_server():
    """One server for the two /v1/listen files (same settings). Registered in conftest.py."""
    s = start_shared("deepgram_server", "--num-slots", str(DEEPGRAM_NUM_SLOTS), "--idle-timeout-s", "20",
                     "--log-level", "debug", env=DEEPGRAM_ENV, fast_ws=True)  # fmt: skip
    yield s
    assert "Traceback" not in s.log(), s.log()[-4000:]
    stop_shared("deepgram_server")


TOKENLESS_CONTEXT_RIGHT = 1  # 160 ms chunks: several packets per short load item (test_loadgen.py's MODE)


@pytest.fixture(scope="session")
def tokenless_server():
    """No auth token, 160 ms chunks (context right 1), eight slots: test_loadgen.py's load levels
    (its generator's lanes) and test_nim_sessions.py's tokenless NIM session (it started its own on
    one slot, default mode: it compares the client's tokens with /ws's on the same server).
    Registered in conftest.py."""
    yield start_shared("tokenless_server", "--context-right", str(TOKENLESS_CONTEXT_RIGHT), "--num-slots", "8", token=None)
    stop_shared("tokenless_server")


@pytest.fixture(name="server")
def leak_checked_server(shared_server):
    """`server` in a test module that imports this: the shared server, and after each test the
    "engine is empty" check (no slot or stream left behind)."""
    yield shared_server
    shared_server.assert_no_leak()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command() -> list[str]:
    script = Path(sys.executable).with_name("nemo-serve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "nemo_serve.cli"]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    token: str | None
    log_path: Path
    cafile: Path | None = None  # set when the server speaks TLS (its self-signed certificate)
    fast_port: int | None = None  # --fast-ws-port (picows), when started with fast_ws=True

    def ws_port(self, listener: str) -> int:
        """The port of one WebSocket listener (LISTENERS): "uvicorn" is --port, "picows" --fast-ws-port."""
        if listener == "uvicorn":
            return self.port
        assert listener == "picows" and self.fast_port is not None, (listener, self.fast_port)
        return self.fast_port

    def ws_base(self, listener: str) -> str:
        """ws://127.0.0.1:PORT of one WebSocket listener (no path)."""
        return f"{'wss' if self.cafile else 'ws'}://127.0.0.1:{self.ws_port(listener)}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.cafile else 'http'}://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.cafile else 'ws'}://127.0.0.1:{self.port}/ws"

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=str(self.cafile)) if self.cafile else None

    @property
    def auth_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.http_url + path, timeout=10, trust_env=False, verify=self.ssl_context or True)

    def readyz(self) -> dict:
        return self.get("/readyz").json()

    def metrics(self) -> str:
        return self.get("/metrics").text

    def metric(self, series: str) -> float:
        """Value of one series, e.g. 'nemo_serve_refusals_total{reason="no_free_slot"}'; 0 if absent."""
        for line in self.metrics().splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_open_streams(self, at_most: int, timeout_s: float = 15.0) -> None:
        """Wait until the engine holds at most `at_most` streams (released slots come back
        between steps, so a step in flight delays a release)."""
        deadline = time.monotonic() + timeout_s
        while self.readyz()["open_streams"] > at_most:
            if time.monotonic() > deadline:
                raise AssertionError(f"streams not released: {self.readyz()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def assert_no_leak(self, timeout_s: float = 15.0) -> None:
        """Every slot is free again (the loop releases a stream just after its last result)."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = self.readyz()
            if r["free_slots"] == r["total_slots"] and r["open_streams"] == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"slot leak: {r}")
            time.sleep(0.1)


def self_signed_certificate(folder: Path) -> tuple[Path, Path] | None:
    """(cert, key) for 127.0.0.1 made with the openssl command; None where there is none."""
    if shutil.which("openssl") is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.contextmanager
def start_server(
    *args: str, token: str | None = TOKEN, model: str = TEST_MODEL, tls: bool = False, env: dict | None = None,
    fast_ws: bool = False,
) -> Iterator[ServerProcess]:
    """`tls=True`: serve https/wss with a fresh self-signed certificate (plain where no openssl).
    `env`: extra NEMO_SERVE_* variables (settings as the environment gives them). `fast_ws=True`:
    the picows listener too (--fast-ws-port on a free port, `fast_port`) where picows is installed."""
    port = free_port()
    fast_port = free_port() if fast_ws and importlib.util.find_spec("picows") else None
    if fast_port is not None:
        args = (*args, "--fast-ws-port", str(fast_port))
    log_path = Path(tempfile.mkstemp(prefix="nemo-serve-e2e-", suffix=".log")[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if token:
        env["NEMO_SERVE_AUTH_TOKEN"] = token  # through the environment, as the docs recommend
    cmd = [*_server_command(), "--model", model, "--port", str(port), "--log-level", "warning", *args]
    pair = self_signed_certificate(log_path.parent / f"{log_path.stem}-tls") if tls else None
    if pair is not None:
        cmd += ["--ssl-certfile", str(pair[0]), "--ssl-keyfile", str(pair[1])]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(proc, port, token, log_path, cafile=pair[0] if pair else None, fast_port=fast_port)
    try:
        _wait_ready(server)
        yield server
    finally:
        stop(server)


def _wait_ready(server: ServerProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"nemo-serve exited with {server.proc.returncode} before ready:\n{server.log()[-3000:]}")
        try:
            if server.get("/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # a refused connection costs nothing; 0.5 s cost each of CI's dozens of starts 0.25 s on average
    pytest.fail(f"nemo-serve not ready after {STARTUP_TIMEOUT_S:.0f} s:\n{server.log()[-3000:]}")


def stop(server: ServerProcess, timeout_s: float = 20.0) -> None:
    """SIGTERM (graceful drain), then SIGKILL of the whole group if it lingers."""
    if server.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


# ----------------------------------------------------------------------------- audio and clients


def encode(samples: np.ndarray, encoding: str) -> np.ndarray:
    """float32 [-1, 1] -> what goes on the wire (int16 for pcm_s16le)."""
    if encoding == "pcm_s16le":
        return np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
    return samples.astype("<f4")


def as_model_input(wire: np.ndarray, rate: int, model_rate: int = 16000) -> np.ndarray:
    """What the server feeds the model for these wire samples (the oracle's input)."""
    import soxr

    x = wire.astype(np.float32) / 32768.0 if wire.dtype.kind == "i" else wire.astype(np.float32)
    return x if rate == model_rate else soxr.resample(x, rate, model_rate, quality="HQ").astype(np.float32)


async def raw_session(
    url: str, first: list, *, token: str | None = TOKEN, timeout_s: float = 30.0, ssl_context=None,
    reasons: list | None = None, burst: bool = False,
) -> tuple[list[dict], int | None]:
    """Send `first` (str or bytes frames) on a raw socket; return every message and the close code
    (and append the close reason to `reasons` when given). `burst`: every frame in one write, so the
    server has them all before it can answer the first (a frame after an end is read before the
    stream's tail is decoded, however loaded the machine)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    headers = {"Authorization": f"Bearer {token}"} if token else None
    extra = {"ssl": ssl_context} if ssl_context is not None else {}
    messages: list[dict] = []
    async with connect(url, additional_headers=headers, max_size=None, compression=None, **extra) as ws:
        try:
            if burst:
                from benchmarks.raw_ws import frame as raw_frame

                ws.transport.write(b"".join(raw_frame(f.encode(), 0x1) if isinstance(f, str) else raw_frame(f, 0x2)
                                            for f in first))  # fmt: skip
            for frame in [] if burst else first:
                await ws.send(frame)
        except ConnectionClosed:
            pass
        try:
            async with asyncio.timeout(timeout_s):
                async for m in ws:
                    # "Done!" (bare text, to clients that ended with "Done"/"eof") as a pseudo message
                    messages.append({"type": m} if m == "Done!" else json.loads(m))
        except ConnectionClosed:
            pass
        if reasons is not None:
            reasons.append(ws.close_reason)
        return messages, ws.close_code


async def ws_pcm16_finals(server, pcm: np.ndarray, rate: int, token: str | None = TOKEN, **client_options) -> list[dict]:
    """/ws's final messages for these PCM16 samples, sent as the clients in the tests send them (packets
    of 100 ms, then end); `client_options`: StreamingClient's (context_right, language, endpointing)."""
    from nemo_serve.client import StreamingClient

    async with StreamingClient(server.ws_url, sample_rate=rate, encoding="pcm_s16le", token=token,
                               **client_options) as c:  # fmt: skip
        for i in range(0, len(pcm), rate // 10):
            await c.send_audio(pcm[i : i + rate // 10])
        await c.end()
        return [m async for m in c.messages() if m["type"] == "final"]


def post_with_every_slot_held(server, num_slots: int, path: str, **request) -> "httpx.Response":
    """POST `path` (httpx's `request` arguments) while `num_slots` /ws streams hold every slot
    (each has sent audio); they end after the answer."""
    import httpx

    from nemo_serve.client import StreamingClient

    async def run() -> httpx.Response:
        clients = [StreamingClient(server.ws_url, sample_rate=16000, encoding="pcm_s16le", token=TOKEN)
                   for _ in range(num_slots)]  # fmt: skip
        for c in clients:
            await c.__aenter__()
            await c.send_audio(np.zeros(1600, dtype="<i2"))
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
                return await http.post(f"{server.http_url}{path}", **request)
        finally:
            for c in clients:
                await c.__aexit__(None, None, None)

    return asyncio.run(run())


def finals_tokens_and_text(finals: list[dict]) -> tuple[list[int], str]:
    """The token ids and the text of a stream's final messages."""
    return [t for f in finals for t in f["token_ids"]], " ".join(f["text"] for f in finals if f["text"])


def pcm16_file(path: Path, rate: int) -> np.ndarray:
    """A bundled utterance as PCM16 at `rate` (soxr HQ when the rate differs), as a client would send it."""
    import soundfile
    import soxr

    audio, file_rate = soundfile.read(path, dtype="float32")
    audio = soxr.resample(audio, file_rate, rate, quality="HQ") if rate != file_rate else audio
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")
