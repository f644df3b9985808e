"""One load level: N streams at real-time pace over WebSockets (its summary and verdict: load_summary.py;
definitions: loadgen.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from benchmarks.common import SAMPLE_RATE
from benchmarks.load_items import LoadItem

HOP_SAMPLES = 160  # the engine's feature look-ahead beyond audio_processed (frontend margin - 1 hop)


@dataclass
class StreamRecord:
    worker: int
    item_id: str
    audio_s: float
    opened: float = 0.0  # client time.time()
    chunk_ms: float | None = None
    send_ends: list[int] = field(default_factory=list)  # cumulative samples after each packet
    send_times: list[float] = field(default_factory=list)
    send_lateness: list[float] = field(default_factory=list)  # s per packet: the generator's own delay (send_paced)
    end_sent: float | None = None
    partials: list[tuple[float, float, float, float]] = field(default_factory=list)  # (recv, processed_s, arrival, sent)
    finals: list[dict] = field(default_factory=list)
    final_recv: float | None = None
    done: bool = False
    error: str | None = None

    def packet_send_time(self, processed_s: float) -> float | None:
        need = int(round(processed_s * SAMPLE_RATE)) + HOP_SAMPLES
        i = bisect_left(self.send_ends, need)
        return self.send_times[i] if i < len(self.send_times) else None

    def partial_latencies(self) -> list[tuple[float, float]]:
        """(audio position s, latency s) of every partial whose packet is known."""
        out = []
        for recv, processed, _, _ in self.partials:
            t = self.packet_send_time(processed)
            if t is not None:
                out.append((processed, recv - t))
        return out

    @property
    def final_latency(self) -> float | None:
        if self.final_recv is None or self.end_sent is None:
            return None
        return self.final_recv - self.end_sent

    @property
    def token_ids(self) -> list[int]:
        return [t for f in self.finals for t in f["token_ids"]]

    @property
    def text(self) -> str:
        return " ".join(f["text"] for f in self.finals if f["text"])


async def stream_item(
    url: str, worker: int, item: LoadItem, endpointing: bool, timeout_s: float, context_right: int | None = None
) -> StreamRecord:
    """One item at real-time pace through websockets' asyncio client (`--client websockets`: each
    packet encoded when sent); `context_right`: the chunk mode to ask for (None: the server's default)."""
    from websockets.asyncio.client import connect

    rec = StreamRecord(worker, item.item_id, len(item.audio) / SAMPLE_RATE, opened=time.time())
    with failures_recorded(rec):
        async with asyncio.timeout(timeout_s):
            async with connect(url, max_size=None, compression=None, open_timeout=30) as ws:
                if not await open_ws_stream(ws, rec, stream_config(worker, item, endpointing, context_right)):
                    return rec
                reader = asyncio.create_task(_read(ws, rec))
                chunk = int(round(rec.chunk_ms * SAMPLE_RATE / 1000))  # packet k is one server chunk
                packets = encoded_packets(item.audio, chunk, lambda p: p.astype(np.float32).tobytes())
                await send_paced(ws.send, packets, rec, lambda: ws.send(END_MESSAGE))
                await reader
    return rec


END_MESSAGE = json.dumps({"type": "end"})


def stream_config(worker: int, item: LoadItem, endpointing: bool, context_right: int | None) -> dict:
    config = {"type": "config", "id": f"w{worker}-{item.item_id}", "encoding": "pcm_f32le", "sample_rate": SAMPLE_RATE}
    if not endpointing:
        config["endpointing"] = {"enabled": False}
    if context_right is not None:
        config["context_right"] = context_right
    return config


async def open_ws_stream(ws, rec: StreamRecord, config: dict) -> bool:
    """/ws: config out, `ready` in (its chunk_ms kept); False with `rec.error` on a refusal.
    `ws`: anything with async send(str) and recv() (either client)."""
    await ws.send(json.dumps(config))
    ready = json.loads(await ws.recv())
    if ready.get("type") != "ready":
        rec.error = f"refused: {ready.get('reason', ready.get('type'))}"
        return False
    rec.chunk_ms = float(ready["chunk_ms"])
    return True


def encoded_packets(audio: np.ndarray, packet: int, message: Callable[[np.ndarray], object]) -> Iterator[tuple[int, object]]:
    """(samples sent after it, payload) per packet, each encoded only when the pacer reaches it."""
    for start in range(0, len(audio), packet):
        samples = audio[start : start + packet]
        yield start + len(samples), message(samples)


class HandshakeRefused(Exception):
    """The picows client's (load_picows.py) HTTP refusal of the upgrade, as websockets' InvalidStatus."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class StreamClosed(Exception):
    """The picows client's connection closed with `code` (None: no close frame) while a stream
    still needed it, as websockets' ConnectionClosedError."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"closed {code}")
        self.code = code


@contextlib.contextmanager
def failures_recorded(rec: StreamRecord):
    """A stream's connection failure kept as `rec.error` (the first error said wins), not raised;
    a stream that ended without `done` is an error too. Every protocol's stream uses it."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    try:
        yield
    except InvalidStatus as e:
        rec.error = f"refused: HTTP {e.response.status_code}"
    except HandshakeRefused as e:
        rec.error = f"refused: HTTP {e.status}"
    except ConnectionClosed as e:
        rec.error = rec.error or f"closed {e.rcvd.code if e.rcvd else 'abnormally'}"
    except StreamClosed as e:
        rec.error = rec.error or f"closed {e.code or 'abnormally'}"
    except TimeoutError:
        rec.error = "timeout"
    except OSError as e:
        rec.error = f"connect: {type(e).__name__}"
    if rec.error is None and not rec.done:
        rec.error = "no done message"


async def send_paced(send: Callable[[object], Awaitable], packets: Iterable[tuple[int, object]], rec: StreamRecord,
                     send_end: Callable[[], Awaitable]) -> None:  # fmt: skip
    """Each packet, (samples sent after it, payload), goes out through `send(payload)` when its
    audio would have been recorded; then `send_end()`."""
    t0 = previous_sent = time.monotonic()  # not loop.time(): uvloop's clock ticks in whole milliseconds
    for end, payload in packets:
        due = t0 + end / SAMPLE_RATE
        while due - time.monotonic() > 0.0005:  # a uvloop timer may fire up to a millisecond early
            await asyncio.sleep(due - time.monotonic())
        # The generator's lateness: how long after the later of its due time and the previous
        # send's return this packet got the event loop. A send held up by TCP backpressure (a
        # server that does not read) is the server's delay, so it is not counted here; a busy
        # or starved generator loop is.
        rec.send_lateness.append(max(0.0, time.monotonic() - max(due, previous_sent)))
        await send(payload)
        previous_sent = time.monotonic()
        rec.send_ends.append(end)
        rec.send_times.append(time.time())
    await send_end()
    rec.end_sent = time.time()


async def _read(ws, rec: StreamRecord) -> None:
    async for raw in ws:
        read_ws_message(rec, time.time(), raw)


def read_ws_message(rec: StreamRecord, now: float, raw: str | bytes) -> bool:
    """One /ws server message into `rec` (either client); True once it was `done`."""
    msg = json.loads(raw)
    kind = msg.get("type")
    if kind == "partial":
        rec.partials.append((now, msg["audio_processed"], msg["audio_arrival_time"], msg["sent_time"]))
    elif kind == "final":
        rec.finals.append({"token_ids": msg["token_ids"], "text": msg["text"], "recv": now})
        rec.final_recv = now
    elif kind == "done":
        rec.done = True
    elif kind == "error":
        rec.error = f"error: {msg.get('reason', '')[:80]}"
    return rec.done


async def run_level(
    url: str,
    items: list[LoadItem],
    num_streams: int,
    duration_s: float,
    ramp_s: float = 2.0,
    endpointing: bool = False,
    progress: bool = True,
    workers: list[int] | None = None,
    context_right: int | None = None,
    protocol: str = "ws",
    client: str = "websockets",
) -> list[StreamRecord]:
    """N workers for duration_s (plus the streams still in flight at the end). `workers`: the
    subset of worker numbers this process runs (load_workers.py); `context_right`: the
    chunk mode every stream asks for (None: the server's default); `protocol`: "ws", or
    "realtime" (`url` is then a /v1/realtime URL; load_realtime.py); `client`: "websockets"
    or "picows" (load_picows.py)."""
    stream = stream_function(protocol, client)
    loop = asyncio.get_running_loop()
    t_end = loop.time() + duration_s
    records: list[StreamRecord] = []
    bar = _bar(duration_s, f"N={num_streams}") if progress else None

    async def worker(w: int) -> None:
        await asyncio.sleep(ramp_s * w / num_streams + random.uniform(0, 0.08))
        k = w * len(items) // num_streams
        while loop.time() < t_end:
            item = items[k % len(items)]
            timeout = 3 * len(item.audio) / SAMPLE_RATE + 60
            records.append(await stream(url, w, item, endpointing, timeout, context_right))
            k += 1
            if records[-1].error and records[-1].error.startswith(("refused", "connect")):
                await asyncio.sleep(1.0)  # do not spin on a refusing server

    tasks = [asyncio.create_task(worker(w)) for w in (workers if workers is not None else range(num_streams))]
    start = loop.time()
    pending = set(tasks)
    while pending:  # the progress bar each second; back as soon as the last stream ends
        _, pending = await asyncio.wait(pending, timeout=1.0)
        if bar is not None:
            bar.n = min(duration_s, loop.time() - start)
            recent = [lat for r in records[-num_streams:] for _, lat in r.partial_latencies()[-3:]]
            bar.set_postfix_str(
                f"streams done {len(records)}, errors {sum(r.error is not None for r in records)}"
                + (f", partial p50 {1000 * float(np.median(recent)):.0f} ms" if recent else "")
            )
            bar.refresh()
    for t in tasks:
        t.result()
    if bar is not None:
        bar.close()
    return records


CLIENTS = ("websockets", "picows")


def default_client() -> str:
    """picows where it is installed (the `fastws` extra): it costs the generator less CPU per packet."""
    try:
        import picows  # noqa: F401
    except ImportError:
        return "websockets"
    return "picows"


def stream_function(protocol: str, client: str) -> Callable[..., Awaitable[StreamRecord]]:
    """(url, worker, item, endpointing, timeout_s, context_right) -> one stream's record."""
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r}: one of {CLIENTS}")
    if client == "picows":
        from benchmarks import load_picows

        if protocol == "realtime":
            return lambda url, w, item, _, timeout, cr: load_picows.stream_item_realtime_picows(url, w, item, timeout, cr)
        return load_picows.stream_item_picows
    if protocol == "realtime":
        from benchmarks.load_realtime import stream_item_realtime

        return lambda url, w, item, _, timeout, cr: stream_item_realtime(url, w, item, timeout, cr)
    return stream_item


def _bar(total: float, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="s", file=sys.stderr, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s{postfix}")
