"""`nemo-serve-client`: stream a WAV file (or the microphone) to a nemo-serve server.

    nemo-serve-client speech.wav                     # real-time pace, partials in place
    nemo-serve-client speech.wav --speed 0           # as fast as the socket takes it
    nemo-serve-client --mic                          # needs the optional `sounddevice` package

Importable:

    async with StreamingClient("ws://localhost:8000/ws", sample_rate=8000, encoding="pcm_s16le") as c:
        await c.send_audio(int16_samples)
        await c.end()
        async for msg in c.messages():
            ...

    transcript = asyncio.run(stream_file("ws://localhost:8000/ws", "speech.wav", speed=0))
    print(transcript.text)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from .audio_io import read_audio

DEFAULT_URL = "ws://127.0.0.1:8000/ws"


class ServerRefused(RuntimeError):
    """The server refused the stream (no free slot, draining, bad token, bad config)."""

    def __init__(self, reason: str, status: int | None = None, close_code: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.status, self.close_code = reason, status, close_code


@dataclass
class Transcript:
    ready: dict | None = None
    finals: list[dict] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    done: dict | None = None
    error: dict | None = None
    close_code: int | None = None

    @property
    def text(self) -> str:
        return " ".join(f["text"] for f in self.finals if f["text"])

    @property
    def token_ids(self) -> list[int]:
        return [t for f in self.finals for t in f["token_ids"]]

    def record(self, msg: dict) -> None:
        """Keep one server message: every message in order, and the finals, `done` and `error` apart."""
        self.messages.append(msg)
        if msg["type"] == "final":
            self.finals.append(msg)
        elif msg["type"] == "done":
            self.done = msg
        elif msg["type"] == "error":
            self.error = msg


class StreamingClient:
    """One stream over one WebSocket: config -> ready -> audio -> end -> results -> done."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        sample_rate: int = 16000,
        encoding: str = "pcm_s16le",
        interim_results: bool = True,
        language: str | None = None,
        stream_id: str | None = None,
        token: str | None = None,
        endpointing: dict | None = None,
        max_message_bytes: int = 1 << 20,
        ssl_context: ssl.SSLContext | None = None,
        context_right: int | None = None,
        phrases: list[str] | None = None,
        boost: float | None = None,
    ) -> None:
        """`context_right`: the chunk mode to stream at, one of those the server serves (its /readyz
        lists them); None: the server's default. `phrases`: words or phrases to boost in this
        stream's decoding, by `boost` (the server's default 1 when None)."""
        self.url = url
        self.token = token
        self.ssl_context = ssl_context  # for wss:// with a private CA or a self-signed certificate
        self.config = {"type": "config", "sample_rate": sample_rate, "encoding": encoding, "interim_results": interim_results}
        for key, value in (("language", language), ("id", stream_id), ("endpointing", endpointing),
                           ("context_right", context_right), ("phrases", phrases), ("boost", boost)):
            if value is not None:
                self.config[key] = value
        self.dtype = np.dtype("<i2") if encoding in ("pcm_s16le", "int16", "s16le") else np.dtype("<f4")
        self.max_message_bytes = max_message_bytes
        self.ready: dict | None = None
        self._ws = None

    async def __aenter__(self) -> "StreamingClient":
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            extra = {"ssl": self.ssl_context} if self.ssl_context is not None and self.url.startswith("wss:") else {}
            self._ws = await connect(self.url, additional_headers=headers, max_size=None, compression=None, **extra)
        except InvalidStatus as e:
            body = e.response.body.decode(errors="replace") if e.response.body else ""
            try:
                reason = json.loads(body)["reason"]
            except (ValueError, KeyError, TypeError):
                reason = body or f"HTTP {e.response.status_code}"
            raise ServerRefused(reason, status=e.response.status_code) from None
        await self._ws.send(json.dumps(self.config))
        first = await self._receive_json()
        if first is None or first["type"] != "ready":
            reason = first["reason"] if first and first["type"] == "error" else "closed before ready"
            code = self._ws.close_code
            await self._ws.close()
            raise ServerRefused(reason, close_code=code)
        self.ready = first
        return self

    async def __aexit__(self, *exc) -> None:
        await self._ws.close()

    @property
    def close_code(self) -> int | None:
        return self._ws.close_code if self._ws else None

    async def send_audio(self, samples: np.ndarray | bytes) -> None:
        """Samples (float in [-1, 1] or int16; converted to the stream's encoding) or raw bytes;
        split to fit the message limit."""
        data = samples if isinstance(samples, bytes) else self._encode(np.asarray(samples)).tobytes()
        step = self.max_message_bytes // self.dtype.itemsize * self.dtype.itemsize
        for i in range(0, len(data), step):
            await self._ws.send(data[i : i + step])

    def _encode(self, x: np.ndarray) -> np.ndarray:
        if self.dtype.kind == "i" and x.dtype.kind == "f":
            return np.round(np.clip(x, -1.0, 32767 / 32768) * 32768).astype(self.dtype)
        if self.dtype.kind == "f" and x.dtype.kind == "i":
            return (x / 32768.0).astype(self.dtype)
        return x.astype(self.dtype, copy=False)

    async def force_final(self) -> None:
        await self._ws.send(json.dumps({"type": "force_final"}))

    async def end(self) -> None:
        await self._ws.send(json.dumps({"type": "end"}))

    async def messages(self) -> AsyncIterator[dict]:
        """Server messages until the server closes (after `done` or `error`)."""
        while (msg := await self._receive_json()) is not None:
            yield msg

    async def _receive_json(self) -> dict | None:
        try:
            return json.loads(await self._ws.recv())
        except ConnectionClosed:
            return None


# ----------------------------------------------------------------------------- files


def read_file(path: str | Path) -> tuple[np.ndarray, int, str]:
    """(mono samples, sample rate, encoding): 8- and 16-bit files are sent as int16, anything else as float32."""
    samples, rate = read_audio(path, dtype="native")
    return samples, rate, "pcm_s16le" if samples.dtype == np.int16 else "pcm_f32le"


async def stream_file(url: str, path: str | Path, **options) -> Transcript:
    """Stream an audio file at `speed` x real time (0: as fast as possible); collect every message."""
    samples, rate, encoding = read_file(path)
    return await stream_samples(url, samples, rate, encoding, **options)


async def stream_samples(
    url: str,
    samples: np.ndarray,
    rate: int,
    encoding: str,
    *,
    speed: float = 1.0,
    chunk_ms: float = 100.0,
    on_message: Callable[[dict], None] | None = None,
    **client_options,
) -> Transcript:
    """Stream samples (int16 for pcm_s16le, float32 for pcm_f32le) and collect every message."""
    async with StreamingClient(url, sample_rate=rate, encoding=encoding, **client_options) as client:
        out = Transcript(ready=client.ready, messages=[client.ready])
        if on_message is not None:
            on_message(client.ready)
        sender = asyncio.create_task(_send_paced(client, samples, rate, speed, chunk_ms))
        try:
            async for msg in client.messages():
                out.record(msg)
                if on_message is not None:
                    on_message(msg)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        out.close_code = client.close_code
    return out


async def _send_paced(client: StreamingClient, samples: np.ndarray, rate: int, speed: float, chunk_ms: float) -> None:
    step = max(1, int(rate * chunk_ms / 1000))
    t0 = time.monotonic()
    for i in range(0, len(samples), step):
        await client.send_audio(samples[i : i + step])
        if speed > 0:  # sleep until this chunk's end, on the file's clock scaled by speed
            await asyncio.sleep(max(0.0, t0 + (i + step) / rate / speed - time.monotonic()))
    await client.end()


# ----------------------------------------------------------------------------- microphone


async def stream_microphone(
    url: str, on_message: Callable[[dict], None], rate: int = 16000, duration_s: float | None = None, **options
) -> None:
    """Stream the default input device until Ctrl-C (or `duration_s`), then wait for the final."""
    try:
        import sounddevice
    except (ImportError, OSError) as e:  # OSError: the package is there but PortAudio is not
        raise SystemExit(
            f"nemo-serve-client: --mic needs the 'sounddevice' package and PortAudio ({e}); "
            "install with: pip install sounddevice"
        ) from None
    loop = asyncio.get_running_loop()
    blocks: asyncio.Queue = asyncio.Queue()

    def callback(indata, frames, time_info, status) -> None:  # PortAudio's thread
        loop.call_soon_threadsafe(blocks.put_nowait, bytes(indata))

    async def capture(client: StreamingClient) -> None:
        with sounddevice.RawInputStream(samplerate=rate, channels=1, dtype="int16", blocksize=rate // 10, callback=callback):
            while True:
                await client.send_audio(await blocks.get())

    async def send(client: StreamingClient) -> None:
        try:
            await asyncio.wait_for(capture(client), duration_s)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            pass
        while not blocks.empty():  # what the device delivered before it closed
            await client.send_audio(blocks.get_nowait())
        await client.end()

    def on_sigint() -> None:
        sender.cancel()
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C quits at once

    async with StreamingClient(url, sample_rate=rate, encoding="pcm_s16le", **options) as client:
        print("listening; Ctrl-C to finish", file=sys.stderr)
        on_message(client.ready)
        sender = asyncio.create_task(send(client))
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        async for msg in client.messages():
            on_message(msg)
        await asyncio.gather(sender, return_exceptions=True)


# ----------------------------------------------------------------------------- printing


class Printer:
    """Partials overwrite one terminal line; finals get lines of their own."""

    def __init__(self, out=sys.stdout, as_json: bool = False) -> None:
        self.out = out
        self.as_json = as_json
        self.tty = out.isatty()
        self.width = shutil.get_terminal_size().columns
        self.segment_text = ""  # the open segment's text, assembled from partials' text_offset + text

    def __call__(self, msg: dict) -> None:
        if self.as_json:
            print(json.dumps(msg), file=self.out, flush=True)
        elif msg["type"] == "partial":
            # A partial of a long segment carries only the text from text_offset on.
            self.segment_text = self.segment_text[: msg.get("text_offset", 0)] + msg["text"]
            if self.tty:
                self.out.write(f"\r\x1b[K  ... {self.segment_text[-(self.width - 12) :]}")
                self.out.flush()
        elif msg["type"] == "final":
            self.segment_text = ""
            clear = "\r\x1b[K" if self.tty else ""
            if msg["text"]:
                print(f"{clear}[{msg['start_time']:7.2f}s] {msg['text']}", file=self.out, flush=True)
            elif self.tty:
                self.out.write(clear)
        elif msg["type"] == "error":
            print(f"\nerror: {msg['reason']}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-serve-client", description="Stream audio to a nemo-serve server.")
    p.add_argument("file", nargs="?", help="audio file (WAV, FLAC, ...; any sample rate)")
    p.add_argument("--mic", action="store_true", help="stream the default microphone instead of a file")
    p.add_argument("--url", default=DEFAULT_URL, help=f"server WebSocket URL (default {DEFAULT_URL})")
    p.add_argument("--speed", type=float, default=1.0, help="x real time; 0 = as fast as possible (default 1)")
    p.add_argument("--chunk-ms", type=float, default=100.0, help="audio per message (default 100)")
    p.add_argument("--language", help="language code, for a multilingual model")
    p.add_argument("--context-right", type=int,
                   help="chunk mode: right context r, chunk (r+1) x 80 ms, one the server serves (default: its default)")
    p.add_argument("--phrase", action="append", dest="phrases", metavar="PHRASE",
                   help="a word or phrase to boost (repeatable), e.g. a name the model rarely hears")
    p.add_argument("--boost", type=float, help="weight of the boosted phrases (server default 1)")
    p.add_argument("--no-interim", action="store_true", help="ask for final results only")
    p.add_argument("--token", help="bearer token (or NEMO_SERVE_AUTH_TOKEN)")
    p.add_argument("--cafile", help="for wss://: trust this certificate (e.g. the server's self-signed one)")
    p.add_argument("--insecure", action="store_true", help="for wss://: do not verify the certificate (testing only)")
    p.add_argument("--json", action="store_true", help="print every server message as a JSON line")
    return p


def _ssl_context(cafile: str | None, insecure: bool) -> ssl.SSLContext | None:
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    return ssl.create_default_context(cafile=cafile) if cafile else None


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    if args.mic == bool(args.file):
        print("nemo-serve-client: give a FILE or --mic", file=sys.stderr)
        return 2
    options = dict(
        language=args.language,
        context_right=args.context_right,
        phrases=args.phrases,
        boost=args.boost,
        interim_results=not args.no_interim,
        token=args.token or os.environ.get("NEMO_SERVE_AUTH_TOKEN"),
        ssl_context=_ssl_context(args.cafile, args.insecure),
    )
    printer = Printer(as_json=args.json)
    try:
        if args.mic:
            asyncio.run(stream_microphone(args.url, printer, **options))
            return 0
        try:
            samples, rate, encoding = read_file(args.file)
        except (OSError, RuntimeError, ValueError) as e:  # soundfile's errors are RuntimeErrors
            print(f"nemo-serve-client: cannot read {args.file}: {e}", file=sys.stderr)
            return 2
        t = asyncio.run(
            stream_samples(args.url, samples, rate, encoding, speed=args.speed, chunk_ms=args.chunk_ms, on_message=printer, **options)
        )
    except ServerRefused as e:
        print(f"nemo-serve-client: refused: {e.reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except (OSError, WebSocketException) as e:
        print(f"nemo-serve-client: cannot connect to {args.url}: {e}", file=sys.stderr)
        return 1
    return 1 if t.error else 0


if __name__ == "__main__":
    sys.exit(main())
