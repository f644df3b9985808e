"""blast.py's wire bytes and schedule: which packet each 2 ms tick sends (Plan), every stream's
masked client frames built once per item, its end of input, and the server's unmasked frames split
after the run. gRPC's frames are blast_grpc.py's, reached through the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.common import SAMPLE_RATE
from benchmarks.load_level import END_MESSAGE
from benchmarks.load_realtime import APPEND_SAMPLES, COMMIT_MESSAGE, append_message, as_pcm16
from benchmarks.raw_ws import SPREAD_S, frame

PACKET_SAMPLES = APPEND_SAMPLES  # 20 ms at 16 kHz, both protocols
RECV_BYTES = 1 << 16
DONE_MARKERS = {"ws": b'"type":"done"', "realtime": b"transcription.completed"}  # early exit only; parsed after
SDK_RATE = 24000  # /v1/realtime's audio/pcm rate in OpenAI's API: what its SDK, pipecat and livekit send
# protocol -> the wire whose opening, end and server messages it has (the rate is the only difference)
WIRES = {"realtime24k": "realtime"}


def wire_of(protocol: str) -> str:
    return WIRES.get(protocol, protocol)


def wire_rate(protocol: str) -> int:
    return SDK_RATE if protocol == "realtime24k" else SAMPLE_RATE


@dataclass
class Plan:
    """Which packet each tick sends: stream i is in group i % groups and sends its packet j at tick
    j * groups + i % groups, due tick * tick_s after the start (tick_s = packet_s / groups: SPREAD_S
    once there are streams enough for every tick). No per-packet state."""

    num_streams: int
    num_packets: int
    groups: int
    tick_s: float
    packet_samples: int = PACKET_SAMPLES

    def due_s(self, tick: np.ndarray | int) -> np.ndarray | float:
        return tick * self.tick_s

    def tick_of(self, stream: int, packet: np.ndarray | int) -> np.ndarray | int:
        return packet * self.groups + stream % self.groups

    def num_ticks(self) -> int:
        return self.num_packets * self.groups

    def streams_of(self, tick: int) -> range:
        return range(tick % self.groups, self.num_streams, self.groups)


def make_plan(num_streams: int, num_packets: int, packet_samples: int = PACKET_SAMPLES) -> Plan:
    packet_s = packet_samples / SAMPLE_RATE
    groups = max(1, min(num_streams, round(packet_s / SPREAD_S)))
    return Plan(num_streams, num_packets, groups, packet_s / groups, packet_samples)


def packet_frames(audio: np.ndarray, protocol: str, num_packets: int, packet_samples: int = PACKET_SAMPLES) -> list[bytes]:
    """One item's masked client frames of `packet_samples` each: float32 binary on /ws (the load
    generator's encoding), the `input_audio_buffer.append` JSON (base64 PCM16) on /v1/realtime."""
    if protocol == "grpc":  # Riva StreamingRecognize: HTTP/2 DATA frames (blast_grpc.py)
        from benchmarks import blast_grpc

        return blast_grpc.packet_frames(audio, num_packets, packet_samples)
    if protocol == "realtime24k":
        audio, packet_samples = at_sdk_rate(audio, num_packets * packet_samples), packet_samples * SDK_RATE // SAMPLE_RATE
    parts = [audio[k * packet_samples : (k + 1) * packet_samples] for k in range(num_packets)]
    if wire_of(protocol) == "realtime":
        return [frame(append_message(as_pcm16(p)).encode(), 0x1) for p in parts]
    return [frame(p.astype(np.float32).tobytes(), 0x2) for p in parts]


def at_sdk_rate(audio: np.ndarray, num_samples: int) -> np.ndarray:
    """The first `num_samples` of 16 kHz `audio` at 24 kHz (soxr, as packet_clients.speech does),
    zero-padded to whole packets where the resampler's output falls a sample short."""
    import soxr

    n = num_samples * SDK_RATE // SAMPLE_RATE
    out = soxr.resample(audio[:num_samples].astype(np.float32), SAMPLE_RATE, SDK_RATE).astype(np.float32)[:n]
    return np.pad(out, (0, n - len(out)))


def split_frames(buf: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """Unmasked server frames in `buf`: ([(opcode, payload)], the bytes of an unfinished frame)."""
    out, i = [], 0
    while len(buf) - i >= 2:
        n, head = buf[i + 1] & 0x7F, 2
        if n >= 126:
            head = 4 if n == 126 else 10
            if len(buf) - i < head:
                break
            n = int.from_bytes(buf[i + 2 : i + head], "big")
        if len(buf) - i < head + n:
            break
        out.append((buf[i] & 0x0F, buf[i + head : i + head + n]))
        i += head + n
    return out, buf[i:]


def server_frame(payload: bytes) -> bytes:
    """An unmasked text frame: a message read past the opening, put back for the parser."""
    n = len(payload)
    size = bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big") if n < 65536 else bytes([127]) + n.to_bytes(8, "big")
    return b"\x81" + size + payload


def end_frame(protocol: str) -> bytes:
    """A stream's end of input: /ws `end`, /v1/realtime one commit, gRPC the client's END_STREAM."""
    if protocol == "grpc":
        from benchmarks import blast_grpc

        return blast_grpc.END_FRAME
    return frame((COMMIT_MESSAGE if wire_of(protocol) == "realtime" else END_MESSAGE).encode(), 0x1)


def done_marker(protocol: str) -> bytes:
    if protocol == "grpc":
        from benchmarks import blast_grpc

        return blast_grpc.DONE_MARKER
    return DONE_MARKERS[wire_of(protocol)]
