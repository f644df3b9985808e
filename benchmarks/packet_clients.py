"""packet_cost.py's wire paths and their clients: per path (protocol, encoding, packet length,
input rate), the packets prebuilt as the pacer writes them (masked WebSocket frames, realtime
JSON appends, Riva gRPC requests), and the connections that send them and count what comes back
by type."""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter

import numpy as np

from benchmarks.raw_ws import Conn, frame

RATE = 16000
PATHS = {  # name: (protocol, encoding, packet_s, input rate)
    "ws_s16_100ms": ("ws", "pcm_s16le", 0.1, RATE),
    "ws_f32_100ms": ("ws", "pcm_f32le", 0.1, RATE),
    "ws_s16_20ms": ("ws", "pcm_s16le", 0.02, RATE),
    "ws_f32_20ms": ("ws", "pcm_f32le", 0.02, RATE),
    "realtime_24k_20ms": ("realtime", "vad", 0.02, 24000),
    "realtime_24k_20ms_novad": ("realtime", "novad", 0.02, 24000),
    "grpc_100ms": ("grpc", "pcm_s16le", 0.1, RATE),
    "grpc_20ms": ("grpc", "pcm_s16le", 0.02, RATE),
}
# --fast-ws: each WebSocket path again through --fast-ws-port (server/picows_listener.py), same packets
FAST = "_fast"
PATHS.update({name + FAST: spec for name, spec in PATHS.items() if spec[0] != "grpc"})
# --fast-grpc: each gRPC path again through --fast-grpc-port (server/fast_grpc.py), same requests
FAST_GRPC = "_fastgrpc"
PATHS.update({name + FAST_GRPC: spec for name, spec in PATHS.items() if spec[0] == "grpc"})


# ----------------------------------------------------------------------------- packets


def speech(audio_manifest: str, rate: int) -> np.ndarray:
    """About a minute of the bundled utterances, float32 at `rate`."""
    from benchmarks.load_items import make_items

    items = make_items(audio_manifest, 4, (10.0, 20.0))
    x = np.concatenate([it.audio for it in items]).astype(np.float32)
    if rate != RATE:
        import soxr

        x = soxr.resample(x, RATE, rate).astype(np.float32)
    return x


def payloads(x: np.ndarray, encoding: str, packet_s: float, rate: int) -> list[bytes]:
    k = int(rate * packet_s)
    pcm = x if encoding == "pcm_f32le" else np.clip(x * 32767, -32768, 32767).astype("<i2")
    return [pcm[i : i + k].astype(pcm.dtype.newbyteorder("<")).tobytes() for i in range(0, len(pcm) - k + 1, k)]


def realtime_frames(pcm16: list[bytes]) -> list[bytes]:
    return [frame(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(p).decode()}).encode(), 0x1)
            for p in pcm16]  # fmt: skip


# ----------------------------------------------------------------------------- clients


class GrpcConn:
    """One Riva StreamingRecognize call fed from a queue the pacer fills."""

    def __init__(self, stub, riva, rate: int) -> None:
        self.counts: Counter = Counter()
        self.ready = asyncio.Event()
        self.error: str | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.riva = riva
        config = riva.StreamingRecognitionConfig(
            config=riva.RecognitionConfig(encoding=1, sample_rate_hertz=rate, language_code="en-US"),  # LINEAR_PCM
            interim_results=True,
        )
        self.queue.put_nowait(riva.StreamingRecognizeRequest(streaming_config=config))
        self.call = stub.StreamingRecognize(self._requests())
        self.task = asyncio.create_task(self._read())
        self.ready.set()  # a call is admitted with its first message; refusals come as an error

    async def _requests(self):
        while (item := await self.queue.get()) is not None:
            yield item

    def write(self, data) -> None:
        self.queue.put_nowait(data)

    async def _read(self) -> None:
        try:
            async for response in self.call:
                self.counts["final" if any(r.is_final for r in response.results) else "partial"] += 1
        except Exception as e:  # noqa: BLE001 - a cancelled call at the end, or a refusal: recorded
            if not isinstance(e, asyncio.CancelledError):
                self.error = repr(e)[:200]

    def close(self) -> None:
        self.queue.put_nowait(None)
        self.call.cancel()
        self.task.cancel()


async def open_streams(path: str, port: int, grpc_port: int, n: int) -> list:
    proto, encoding, packet_s, rate = PATHS[path]
    if proto == "grpc":
        import grpc

        from nemo_serve.server.riva_protos import load

        asr_pb2, asr_grpc, _ = load()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = asr_grpc.RivaSpeechRecognitionStub(channel)
        return [GrpcConn(stub, asr_pb2, rate) for _ in range(n)]
    conns = [Conn() for _ in range(n)]
    for c in conns:
        if proto == "ws":
            cfg = {"type": "config", "encoding": encoding, "sample_rate": rate}
            await c.open(port, "/ws", frame(json.dumps(cfg).encode(), 0x1), "ready")
        else:
            td = {"type": "server_vad"} if encoding == "vad" else None
            update = {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": rate}, "turn_detection": td}}}}  # fmt: skip
            await c.open(port, "/v1/realtime?intent=transcription", frame(json.dumps(update).encode(), 0x1),
                         "session.updated")  # fmt: skip
    await asyncio.wait_for(asyncio.gather(*(c.ready.wait() for c in conns)), 60)
    bad = [c.error for c in conns if c.error]
    if bad:
        raise RuntimeError(f"{len(bad)} streams refused: {bad[0]}")
    return conns


def wire_packets(path: str, x_by_rate: dict) -> list:
    """What the pacer writes, one item per packet: a masked frame, or a gRPC request."""
    proto, encoding, packet_s, rate = PATHS[path]
    pcm = payloads(x_by_rate[rate], "pcm_s16le" if proto != "ws" else encoding, packet_s, rate)
    if proto == "ws":
        return [frame(p, 0x2) for p in pcm]
    if proto == "realtime":
        return realtime_frames(pcm)
    from nemo_serve.server.riva_protos import load

    asr_pb2 = load()[0]
    return [asr_pb2.StreamingRecognizeRequest(audio_content=p) for p in pcm]
