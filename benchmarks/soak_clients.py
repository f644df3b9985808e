"""The soak benchmark's clients: one stream on each protocol, ended well or dropped, returning
(outcome, result). An `ended` stream's result is what a quiet run of the same audio is compared
with: token ids on /ws, /v1/realtime and the file API, final transcripts on Riva (its responses
carry no token ids). Dropped streams return no result; the server must only give their slots back.

Outcomes: ended; dropped_rst (SO_LINGER 0, then close: a TCP reset), dropped_fin (the socket shut
for writing, no close frame), aborted (a WebSocket close frame mid-stream, no `end`);
closed_after_append (/v1/realtime: appends, then the close, no commit); refused_busy (503 at the
handshake or 1013 just after: every slot held for a moment); error (anything else).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
PACKET_SAMPLES = 1600  # 100 ms
DROP_KINDS = ("dropped_rst", "dropped_fin", "aborted")
BUSY_CLOSE = 1013
TRANSCRIPTION = "conversation.item.input_audio_transcription"


async def _paced(pcm: np.ndarray, speed: float, send, upto: int | None = None) -> None:
    """`send(packet)` for each 100 ms packet of `pcm[:upto]` at `speed` x real time."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    end = len(pcm) if upto is None else upto
    for i in range(0, end, PACKET_SAMPLES):
        await send(pcm[i : min(i + PACKET_SAMPLES, end)])
        await asyncio.sleep(max(0.0, t0 + (i + PACKET_SAMPLES) / SAMPLE_RATE / speed - loop.time()))


def _drop(ws, how: str) -> None:
    """End the connection as a vanished client would: a reset, or a bare FIN."""
    sock = ws.transport.get_extra_info("socket")
    if how == "dropped_rst":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    else:
        sock.shutdown(socket.SHUT_WR)
    ws.transport.abort()


def _busy(e: BaseException) -> bool:
    status = getattr(getattr(e, "response", None), "status_code", None)
    code = getattr(getattr(e, "rcvd", None), "code", None)
    return status == 503 or code == BUSY_CLOSE


async def ws_stream(port: int, token: str, pcm: np.ndarray, how: str, speed: float, timeout_s: float = 60.0):
    """One /ws stream of PCM16 `pcm`: `how` is `ended` or one of DROP_KINDS (after half the audio)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    try:
        async with asyncio.timeout(timeout_s):
            ws = await connect(f"ws://127.0.0.1:{port}/ws", additional_headers={"Authorization": f"Bearer {token}"},
                               compression=None, max_size=None)  # fmt: skip
            try:
                await ws.send(json.dumps({"type": "config", "encoding": "pcm_s16le", "sample_rate": SAMPLE_RATE}))
                ready = json.loads(await ws.recv())
                if ready.get("type") != "ready":
                    return "error", ready
                if how != "ended":
                    await _paced(pcm, speed, lambda p: ws.send(p.tobytes()), upto=len(pcm) // 2)
                    if how == "aborted":
                        await ws.close()
                    else:
                        _drop(ws, how)
                    return how, None
                sender = asyncio.create_task(_send_then_end(ws, pcm, speed))
                tokens: list[int] = []
                async for raw in ws:
                    msg = json.loads(raw)
                    if msg["type"] == "final":
                        tokens += msg["token_ids"]
                    elif msg["type"] in ("done", "error"):
                        break
                await sender
                return ("ended", tokens) if msg["type"] == "done" else ("error", msg)
            finally:
                await ws.close()
    except (InvalidStatus, ConnectionClosed) as e:
        return ("refused_busy", None) if _busy(e) else ("error", repr(e)[:200])
    except (OSError, TimeoutError) as e:
        return "error", repr(e)[:200]


async def _send_then_end(ws, pcm: np.ndarray, speed: float) -> None:
    await _paced(pcm, speed, lambda p: ws.send(p.tobytes()))
    await ws.send(json.dumps({"type": "end"}))


async def realtime_stream(port: int, token: str, pcm: np.ndarray, how: str, speed: float, timeout_s: float = 60.0):
    """One /v1/realtime session: appends of 100 ms at `speed`, then one commit (`ended`), or the
    close right after the appends (`closed_after_append`)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    def append(p: np.ndarray) -> str:
        return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(p.tobytes()).decode()})

    session = {"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE},
                                                            "turn_detection": None}}}  # fmt: skip
    try:
        async with asyncio.timeout(timeout_s):
            async with connect(f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription", compression=None,
                               additional_headers={"Authorization": f"Bearer {token}"}, max_size=None) as ws:  # fmt: skip
                created = json.loads(await ws.recv())
                await ws.send(json.dumps({"type": "session.update", "session": session}))
                updated = json.loads(await ws.recv())
                if created.get("type") != "session.created" or updated.get("type") != "session.updated":
                    return "error", updated
                await _paced(pcm, speed, lambda p: ws.send(append(p)))
                if how == "closed_after_append":
                    return how, None
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                async for raw in ws:
                    msg = json.loads(raw)
                    if msg["type"] == f"{TRANSCRIPTION}.completed":
                        return "ended", msg["nemo_serve"]["token_ids"]
                    if msg["type"] == "error":
                        return "error", msg
                return "error", "closed before completed"
    except (InvalidStatus, ConnectionClosed) as e:
        return ("refused_busy", None) if _busy(e) else ("error", repr(e)[:200])
    except (OSError, TimeoutError) as e:
        return "error", repr(e)[:200]


def file_upload(port: int, token: str, wav: Path, timeout_s: float = 60.0):
    """POST /v1/audio/transcriptions (verbose_json): the segments' token ids."""
    import httpx

    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/transcriptions", headers={"Authorization": f"Bearer {token}"},
                       files={"file": (wav.name, wav.read_bytes())}, data={"response_format": "verbose_json"},
                       timeout=timeout_s)  # fmt: skip
    except httpx.HTTPError as e:
        return "error", repr(e)[:200]
    if r.status_code == 503:
        return "refused_busy", None
    if r.status_code != 200:
        return "error", r.text[:200]
    return "ended", [t for s in r.json()["segments"] for t in s["tokens"]]


def riva_available() -> bool:
    try:
        import grpc  # noqa: F401
        import riva.client  # noqa: F401
    except ImportError:
        return False
    return True


def riva_stream(grpc_port: int, token: str, wav: Path):
    """One Riva StreamingRecognize call with NVIDIA's riva.client (the WAV sent as it is, 100 ms
    chunks): the final transcripts."""
    import grpc
    import riva.client as riva

    auth = riva.Auth(uri=f"127.0.0.1:{grpc_port}", metadata_args=[["authorization", f"Bearer {token}"]])
    config = riva.StreamingRecognitionConfig(
        config=riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US", max_alternatives=1),
        interim_results=False,
    )  # fmt: skip
    riva.add_audio_file_specs_to_config(config, wav)
    try:
        with riva.AudioChunkFileIterator(str(wav), PACKET_SAMPLES) as chunks:
            finals = [r.alternatives[0].transcript for resp in riva.ASRService(auth).streaming_response_generator(chunks, config)
                      for r in resp.results if r.is_final]  # fmt: skip
    except grpc.RpcError as e:
        busy = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED or e.code() == grpc.StatusCode.UNAVAILABLE
        return ("refused_busy", None) if busy else ("error", f"{e.code()}: {e.details()}"[:200])
    finally:
        auth.channel.close()
    return "ended", finals
