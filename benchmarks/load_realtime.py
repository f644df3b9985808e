"""One load-generator stream over /v1/realtime: OpenAI's guide flow as voice agents send it.

GA `session.update` (PCM16 at 16 kHz, `turn_detection: null`), then `input_audio_buffer.append`
every 20 ms of audio (base64 in JSON, the packet size of the OpenAI SDK's guide, pipecat and
livekit), paced and timed by load_level.send_paced as /ws packets are (with the generator's own
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
from benchmarks.load_level import StreamRecord, encoded_packets, failures_recorded, send_paced

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

    rec = StreamRecord(worker, item.item_id, len(item.audio) / SAMPLE_RATE, opened=time.time())
    with failures_recorded(rec):
        async with asyncio.timeout(timeout_s):
            async with connect(url + realtime_query(context_right), max_size=None, compression=None, open_timeout=30) as ws:
                if not await configure(ws, rec):
                    return rec
                reader = asyncio.create_task(_read(ws, rec))
                packets = encoded_packets(as_pcm16(item.audio), APPEND_SAMPLES, append_message)
                await send_paced(ws.send, packets, rec, lambda: ws.send(COMMIT_MESSAGE))  # one commit: the whole item
                await reader
    return rec


def realtime_query(context_right: int | None) -> str:
    return "?intent=transcription" + (f"&context_right={context_right}" if context_right is not None else "")


COMMIT_MESSAGE = json.dumps({"type": "input_audio_buffer.commit"})


def append_message(pcm: np.ndarray) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode()})


async def configure(ws, rec: StreamRecord, rate: int = SAMPLE_RATE) -> bool:
    """The session set up as the guide does: transcription, `turn_detection: null`, PCM16 at `rate`
    (16 kHz here; blast.py's SDK shape asks for OpenAI's 24 kHz, which the server resamples)."""
    created = json.loads(await ws.recv())
    session = {"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate},
                                                            "turn_detection": None}}}  # fmt: skip
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    updated = json.loads(await ws.recv())
    if created.get("type") != "session.created" or updated.get("type") != "session.updated":
        rec.error = f"refused: {updated.get('error', {}).get('code', updated.get('type'))}"
        return False
    mode = updated["session"].get("context_right", created["session"].get("context_right"))
    rec.chunk_ms = 80.0 * (int(mode) + 1)
    return True


async def _read(ws, rec: StreamRecord) -> None:
    async for raw in ws:
        if read_realtime_message(rec, time.time(), raw):
            return  # one item per stream: its completed ends it (the client closes, as the guide does)


def read_realtime_message(rec: StreamRecord, now: float, raw: str | bytes) -> bool:
    """One /v1/realtime server message into `rec` (either client); True once the stream is over
    (its `completed`, or an error)."""
    msg = json.loads(raw)
    kind = msg.get("type")
    if kind == f"{TRANSCRIPTION}.completed":
        extra = msg.get("nemo_serve") or {}
        rec.finals.append({"token_ids": extra.get("token_ids", []), "text": msg.get("transcript", ""), "recv": now})
        rec.final_recv = now
        rec.done = True
        return True
    if kind == "error":
        rec.error = f"error: {str(msg.get('error', {}).get('message', ''))[:80]}"
        return True
    return False
