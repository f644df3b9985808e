"""One load-generator stream over /v1/realtime: OpenAI's guide flow as voice agents send it.

GA `session.update` (PCM16 at 16 kHz, `turn_detection: null`), then `input_audio_buffer.append`
every 20 ms of audio (base64 in JSON, the packet size of the OpenAI SDK's guide, pipecat and
livekit), paced and timed as load_level._send_paced does /ws packets (with the generator's own
lateness per packet), then one `commit` for the whole item; the item's `completed` carries the
tokens (`nemo_serve.token_ids`). 16 kHz rather than 24: the items' oracle tokens are NeMo's loop on
16 kHz audio, so no resampler stands between them (loadgen.py rounds the items to the PCM16 grid
when it speaks this protocol, so /ws f32 and this carry the same samples).

Measured: final latency (the `completed` after the commit) and errors; deltas carry no audio
position, so there is no partial latency or drift here (load_workers.judge uses the finals).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np

from benchmarks.common import SAMPLE_RATE
from benchmarks.load_items import LoadItem
from benchmarks.load_level import StreamRecord

APPEND_SAMPLES = SAMPLE_RATE // 50  # 20 ms
TRANSCRIPTION = "conversation.item.input_audio_transcription"


def as_pcm16(audio: np.ndarray) -> np.ndarray:
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")


def on_pcm16_grid(audio: np.ndarray) -> np.ndarray:
    """The float samples a server reads back from `as_pcm16(audio)`."""
    return (as_pcm16(audio).astype(np.float32) / 32768.0).astype(np.float32)


async def stream_item_realtime(url: str, worker: int, item: LoadItem, timeout_s: float,
                               context_right: int | None = None) -> StreamRecord:  # fmt: skip
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    rec = StreamRecord(worker, item.item_id, len(item.audio) / SAMPLE_RATE, opened=time.time())
    query = "?intent=transcription" + (f"&context_right={context_right}" if context_right is not None else "")
    try:
        async with asyncio.timeout(timeout_s):
            async with connect(url + query, max_size=None, compression=None, open_timeout=30) as ws:
                if not await _configure(ws, rec):
                    return rec
                reader = asyncio.create_task(_read(ws, rec))
                await _append_paced(ws, as_pcm16(item.audio), rec)
                await reader
    except InvalidStatus as e:
        rec.error = f"refused: HTTP {e.response.status_code}"
    except ConnectionClosed as e:
        rec.error = rec.error or f"closed {e.rcvd.code if e.rcvd else 'abnormally'}"
    except TimeoutError:
        rec.error = "timeout"
    except OSError as e:
        rec.error = f"connect: {type(e).__name__}"
    if rec.error is None and not rec.done:
        rec.error = "no done message"
    return rec


async def _configure(ws, rec: StreamRecord) -> bool:
    created = json.loads(await ws.recv())
    session = {"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE},
                                                            "turn_detection": None}}}  # fmt: skip
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    updated = json.loads(await ws.recv())
    if created.get("type") != "session.created" or updated.get("type") != "session.updated":
        rec.error = f"refused: {updated.get('error', {}).get('code', updated.get('type'))}"
        return False
    mode = updated["session"].get("context_right", created["session"].get("context_right"))
    rec.chunk_ms = 80.0 * (int(mode) + 1)
    return True


async def _append_paced(ws, pcm: np.ndarray, rec: StreamRecord) -> None:
    """As load_level._send_paced (the same lateness rule), in 20 ms appends, then one commit."""
    t0 = previous_sent = time.monotonic()  # not loop.time(): uvloop's clock ticks in whole milliseconds
    for start in range(0, len(pcm), APPEND_SAMPLES):
        packet = pcm[start : start + APPEND_SAMPLES]
        due = t0 + (start + len(packet)) / SAMPLE_RATE
        while due - time.monotonic() > 0.0005:  # a uvloop timer may fire up to a millisecond early
            await asyncio.sleep(due - time.monotonic())
        rec.send_lateness.append(max(0.0, time.monotonic() - max(due, previous_sent)))
        audio = base64.b64encode(packet.tobytes()).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        previous_sent = time.monotonic()
        rec.send_ends.append(start + len(packet))
        rec.send_times.append(time.time())
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    rec.end_sent = time.time()


async def _read(ws, rec: StreamRecord) -> None:
    async for raw in ws:
        now = time.time()
        msg = json.loads(raw)
        kind = msg.get("type")
        if kind == f"{TRANSCRIPTION}.completed":
            extra = msg.get("nemo_serve") or {}
            rec.finals.append({"token_ids": extra.get("token_ids", []), "text": msg.get("transcript", ""), "recv": now})
            rec.final_recv = now
            rec.done = True
            return  # one item per stream: its completed ends it (the client closes, as the guide does)
        if kind == "error":
            rec.error = f"error: {str(msg.get('error', {}).get('message', ''))[:80]}"
            return
