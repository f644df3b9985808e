"""The browser page in headless Chromium against the real server.

- the microphone: Chromium's fake capture device plays a WAV file (once: `%noloop`); the page
  streams it and renders partials and finals;
- "Try a sample": the page fetches a bundled utterance, streams it at real-time pace in the mode
  picked on the page, shows each final with its latency, and its free-slot count follows /readyz;
  the finals must equal those of a plain WebSocket client sending the same samples.

Driven over the Chrome DevTools protocol with `websockets` (no selenium, no browser download).
Skipped where no Chromium is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile

from . import helpers
from .helpers_server import SHARED_NUM_SLOTS, TOKEN, raw_session

CHROMIUM = os.environ.get("NEMO_SERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary")


@pytest.fixture
def server(shared_server):
    return shared_server


@contextlib.contextmanager
def chromium(audio_file: Path | None = None):
    """Headless Chromium with a fake microphone; yields the DevTools port. Killed in finally."""
    profile = Path(tempfile.mkdtemp(prefix="nemo-serve-chromium-"))
    args = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--remote-debugging-port=0",
        "--use-fake-device-for-media-stream",
        "--use-fake-ui-for-media-stream",
        "--autoplay-policy=no-user-gesture-required",
        "about:blank",
    ]
    if audio_file is not None:
        args.insert(-1, f"--use-file-for-fake-audio-capture={audio_file}%noloop")
    log = open(profile / "chromium.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"  # Chromium writes its port here when listening
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chromium did not start:\n{(profile / 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield int(port_file.read_text().split()[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


class DevTools:
    """The few Chrome DevTools protocol calls the test needs, over one page's WebSocket."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.last_id = 0

    async def call(self, method: str, **params):
        self.last_id += 1
        await self.ws.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == self.last_id:  # anything else is an event; this test needs none
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def eval(self, expression: str, user_gesture: bool = False):
        r = await self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True, userGesture=user_gesture
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = await self.eval(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        state = await self.eval("JSON.stringify({state: nemoServe.state, status: status.textContent, messages: nemoServe.messages.slice(-3)})")
        raise AssertionError(f"timed out waiting for {expression!r}; page: {state}")


async def _page_socket(devtools_port: int) -> str:
    import httpx

    async with httpx.AsyncClient(trust_env=False) as http:
        targets = (await http.get(f"http://127.0.0.1:{devtools_port}/json/list")).json()
    return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


async def open_page(ws, server) -> DevTools:
    """The served page loaded in the tab behind `ws`, its script ready; browsers send the token in
    the query."""
    page = DevTools(ws)
    await page.call("Page.enable")
    await page.call("Page.navigate", url=f"{server.http_url}/?token={TOKEN}")
    await page.wait_for("document.readyState === 'complete' && !!window.nemoServe", 30)
    return page


def test_page_streams_microphone_and_shows_final(server, tmp_path):
    audio = helpers.utterances(1, seed=2)[0]
    seconds = len(audio) / 16000
    wav = tmp_path / "mic.wav"
    soundfile.write(wav, np.concatenate([audio, np.zeros(8000, np.float32)]), 16000, subtype="PCM_16")

    async def drive(devtools_port: int) -> dict:
        from websockets.asyncio.client import connect

        async with connect(await _page_socket(devtools_port), max_size=None) as ws:
            page = await open_page(ws, server)
            await page.wait_for("document.getElementById('slots').textContent.includes('slots free')", 30)
            await page.eval("document.getElementById('start').click()", user_gesture=True)
            await page.wait_for("nemoServe.state === 'streaming'", 30)
            await page.wait_for("nemoServe.messages.some(m => m.type === 'partial')", 60)
            await asyncio.sleep(seconds + 0.5)  # let the fake microphone play the whole file
            await page.eval("document.getElementById('stop').click()", user_gesture=True)
            await page.wait_for("nemoServe.state === 'done'", 60)
            return await page.eval(
                "({finals: nemoServe.finals, shown: document.getElementById('finals').innerText,"
                " messages: nemoServe.messages, status: document.getElementById('status').textContent})"
            )

    with chromium(wav) as devtools_port:
        result = asyncio.run(drive(devtools_port))

    types = [m["type"] for m in result["messages"]]
    assert types[0] == "ready" and types[-1] == "done", types
    assert result["messages"][0]["input_sample_rate"] in (16000, 44100, 48000)
    finals = [m for m in result["messages"] if m["type"] == "final"]
    assert finals and any(f["text"] for f in finals), "no final text from the server"
    for f in finals:
        if f["text"]:
            # every final is on the page (as HTML shows text: runs of spaces collapse to one)
            assert " ".join(f["text"].split()) in " ".join(result["shown"].split()), (f["text"], result["shown"])
    assert result["finals"] == [f["text"] for f in finals if f["text"]]
    assert result["messages"][-1]["audio_processed"] >= 0.8 * seconds  # the whole file went through
    assert result["status"].startswith("done")
    server.assert_no_leak()


SAMPLES = Path(__file__).resolve().parents[1] / "nemo_serve" / "assets" / "demo" / "utterances"


def _direct_finals(server, samples: np.ndarray, context_right: int | None) -> list[str]:
    """The finals a plain WebSocket client gets for these float32 samples at 16 kHz."""
    config = {"type": "config", "sample_rate": 16000, "encoding": "pcm_f32le", "interim_results": False}
    if context_right is not None:
        config["context_right"] = context_right
    frames = [json.dumps(config), samples.astype("<f4").tobytes(), json.dumps({"type": "end"})]
    messages, _ = asyncio.run(raw_session(server.ws_url, frames))
    return [m["text"] for m in messages if m["type"] == "final" and m["text"]]


def test_page_streams_a_sample_and_shows_finals_with_latency(server):
    sample = json.loads((SAMPLES / "manifest.jsonl").read_text().splitlines()[0])  # the button's first pick
    samples, rate = soundfile.read(SAMPLES / sample["audio_filepath"], dtype="float32")
    assert rate == 16000
    seconds = len(samples) / rate
    fastest = min(server.readyz()["modes"], key=lambda m: m["chunk_ms"])  # not the default mode

    async def drive(devtools_port: int) -> dict:
        from websockets.asyncio.client import connect

        async with connect(await _page_socket(devtools_port), max_size=None) as ws:
            page = await open_page(ws, server)
            await page.wait_for(f"slots.dataset.free === '{SHARED_NUM_SLOTS}' && !sample.hidden", 30)
            await page.eval(f"mode.value = '{fastest['context_right']}'")
            started = time.monotonic()
            await page.eval("sample.click()", user_gesture=True)
            await page.wait_for("nemoServe.state === 'streaming'", 30)
            # the slot count is polled while streaming: this stream holds one
            await page.wait_for(f"slots.dataset.free === '{SHARED_NUM_SLOTS - 1}'", 10)
            await page.wait_for("nemoServe.state === 'done'", seconds + 60)
            elapsed = time.monotonic() - started
            await page.wait_for(f"slots.dataset.free === '{SHARED_NUM_SLOTS}'", 10)
            shown = await page.eval(
                "({finals: nemoServe.finals, latencies: nemoServe.latencies_ms, messages: nemoServe.messages,"
                " rows: [...document.querySelectorAll('#finals p')].map(p => p.innerText),"
                " latencyCells: [...document.querySelectorAll('#finals p .latency')].map(e => e.textContent),"
                " partial: document.getElementById('partial').textContent,"
                " reference: document.getElementById('reference').textContent})"
            )
            return shown | {"elapsed": elapsed}

    with chromium() as devtools_port:
        shown = asyncio.run(drive(devtools_port))

    messages = shown["messages"]
    assert messages[0]["type"] == "ready" and messages[-1]["type"] == "done", [m["type"] for m in messages]
    assert messages[0]["context_right"] == fastest["context_right"], messages[0]  # the picked mode
    assert messages[0]["encoding"] == "pcm_f32le" and messages[0]["input_sample_rate"] == 16000
    assert shown["elapsed"] >= 0.9 * seconds, shown["elapsed"]  # real-time pace, not all at once
    assert sample["text"] in shown["reference"]

    # the same samples from a plain client in the same mode: the page changed none of them
    expected = _direct_finals(server, samples, fastest["context_right"])
    assert expected, "the model gave no final text for the sample"
    assert shown["finals"] == expected

    # finals apart from the partial, each on its own row with a latency in ms
    assert shown["partial"] == ""
    assert len(shown["rows"]) == len(expected)
    for row, text in zip(shown["rows"], expected):
        assert " ".join(text.split()) in " ".join(row.split()), (text, row)
    assert len(shown["latencies"]) == len(expected)
    for latency, cell in zip(shown["latencies"], shown["latencyCells"]):
        assert isinstance(latency, int) and 0 <= latency < 30_000, shown["latencies"]
        assert cell == f"latency {latency} ms"
    server.assert_no_leak()


def test_page_transcribes_a_picked_file(server, tmp_path):
    """The file picker: a WAV chosen in the page is decoded by the browser and streamed unchanged."""
    samples, rate = soundfile.read(SAMPLES / "002.wav", dtype="float32")
    wav = tmp_path / "mine.wav"
    soundfile.write(wav, samples, rate, subtype="PCM_16")  # the same 16-bit samples under another name

    async def drive(devtools_port: int) -> dict:
        from websockets.asyncio.client import connect

        async with connect(await _page_socket(devtools_port), max_size=None) as ws:
            page = await open_page(ws, server)
            await page.wait_for("mode.options.length > 0", 30)
            root = (await page.call("DOM.getDocument"))["root"]["nodeId"]
            node = (await page.call("DOM.querySelector", nodeId=root, selector="#file"))["nodeId"]
            await page.call("DOM.setFileInputFiles", files=[str(wav)], nodeId=node)  # fires `change`
            await page.wait_for("nemoServe.state === 'streaming'", 30)
            await page.wait_for("nemoServe.state === 'done'", len(samples) / rate + 60)
            return await page.eval("({finals: nemoServe.finals, reference: reference.textContent,"
                                   " ready: nemoServe.messages[0]})")

    with chromium() as devtools_port:
        shown = asyncio.run(drive(devtools_port))

    assert "mine.wav" in shown["reference"]
    assert shown["ready"]["context_right"] == server.readyz()["context_right"]  # the default mode, first option
    expected = _direct_finals(server, samples, None)
    assert expected and shown["finals"] == expected
    server.assert_no_leak()
