"""blast.py's gRPC protocol: Riva StreamingRecognize streams for `packet_cost_streams.py --client
blast` (issue 48), as cheap per packet as its WebSocket frames.

Each stream is a connection of its own with one call on HTTP/2 stream 1, so every stream of an
item sends the very same bytes: the DATA frame holding the gRPC message (StreamingRecognizeRequest
audio_content, PCM16) of each packet, built once with the server's own framing code
(nemo_serve/server/h2_frames.py). The opening (preface, SETTINGS with windows large enough that the
server never waits on us, the call's HEADERS, the streaming_config message) goes out on a blocking
socket; the call is admitted by the server when its handler runs, so a refusal shows as the call's
status, read after the run. The server's bytes are parsed only after the run (blast.fill_records):
frames, HPACK for the header blocks (one decoder per connection), gRPC messages into the load
generator's StreamRecords: a partial per interim result (its audio_processed), a final per final
result (its characters stand for tokens: Riva's results carry text only, so the oracle here is
/ws's final text, spaces dropped, as a Riva stream's segments end where the server's endpointer
says while the load generator's /ws streams ask for none: a word split by a segment end is still
the same characters), `done` at the trailers' grpc-status 0.
"""

from __future__ import annotations

import socket
import time

import hpack
import numpy as np

from benchmarks.load_level import StreamRecord
from benchmarks.load_realtime import as_pcm16
from nemo_serve.server import h2_frames
from nemo_serve.server.riva_protos import load

PATH = "/nvidia.riva.asr.RivaSpeechRecognition/StreamingRecognize"
SID = 1  # the one call of each connection
# The trailers' frame header after its length: HEADERS, END_HEADERS | END_STREAM, stream 1 (early exit only)
DONE_MARKER = bytes([h2_frames.HEADERS, h2_frames.END_HEADERS | h2_frames.END_STREAM]) + SID.to_bytes(4, "big")
END_FRAME = h2_frames.frame(h2_frames.DATA, h2_frames.END_STREAM, SID)
WINDOW = (1 << 31) - 1


def _message(request) -> bytes:
    data = request.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def packet_frames(audio: np.ndarray, num_packets: int, packet_samples: int) -> list[bytes]:
    pb = load()[0]
    return [h2_frames.frame(h2_frames.DATA, 0, SID, _message(pb.StreamingRecognizeRequest(
        audio_content=as_pcm16(audio[k * packet_samples : (k + 1) * packet_samples]).tobytes())))  # fmt: skip
            for k in range(num_packets)]


def opening(token: str | None = None) -> bytes:
    """What a stream sends before its audio (the same bytes for every stream)."""
    pb = load()[0]
    settings = (h2_frames.S_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + WINDOW.to_bytes(4, "big"))
    headers = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "127.0.0.1"),
               ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
    if token:
        headers.append(("authorization", f"Bearer {token}"))
    config = pb.StreamingRecognizeRequest(streaming_config=pb.StreamingRecognitionConfig(
        config=pb.RecognitionConfig(encoding=1, sample_rate_hertz=16000), interim_results=True))  # fmt: skip
    return (h2_frames.PREFACE + h2_frames.frame(h2_frames.SETTINGS, 0, 0, settings)
            + h2_frames.window_update(0, WINDOW - 65535)
            + h2_frames.frame(h2_frames.HEADERS, h2_frames.END_HEADERS, SID, hpack.Encoder().encode(headers))
            + h2_frames.frame(h2_frames.DATA, 0, SID, _message(config)))  # fmt: skip


def open_stream(port: int, worker: int, item, chunk_ms: float | None) -> tuple[socket.socket | None, StreamRecord, bytes]:
    """One call opened: (non-blocking socket, or None if the connection failed; its record; the
    bytes read while opening: the server's SETTINGS)."""
    rec = StreamRecord(worker, item.item_id, len(item.audio) / 16000, opened=time.time(), chunk_ms=chunk_ms)
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(opening())
        first = sock.recv(1 << 16)  # the server's SETTINGS: the connection is up
        sock.sendall(h2_frames.frame(h2_frames.SETTINGS, h2_frames.ACK, 0))
    except OSError as e:
        rec.error = f"connect: {e!r}"[:120]
        return None, rec, b""
    sock.setblocking(False)
    return sock, rec, first


def read_stream(rec: StreamRecord, parts: list[tuple[float, bytes]]) -> None:
    """A connection's bytes, (time, bytes) as they came, into its record."""
    pb = load()[0]
    decoder, buf, messages = hpack.Decoder(), b"", b""
    for t, data in parts:
        buf += data
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            kind, payload, buf = buf[3], buf[9 : 9 + n], buf[9 + n :]
            if kind == h2_frames.DATA:
                messages += payload
                while len(messages) >= 5 and len(messages) >= 5 + (size := int.from_bytes(messages[1:5], "big")):
                    _result(rec, t, pb.StreamingRecognizeResponse.FromString(messages[5 : 5 + size]))
                    messages = messages[5 + size :]
            elif kind == h2_frames.HEADERS:
                fields = dict(decoder.decode(payload))
                if "grpc-status" in fields and fields["grpc-status"] != "0":
                    rec.error = f"grpc status {fields['grpc-status']}: {fields.get('grpc-message', '')[:80]}"
                elif "grpc-status" in fields:
                    rec.done = True
            elif kind in (h2_frames.RST_STREAM, h2_frames.GOAWAY) and not rec.done and rec.error is None:
                rec.error = f"HTTP/2 frame {kind} from the server"


def characters(text: str) -> list[str]:
    """What a final is compared by (the module's docstring says why): its characters, no spaces."""
    return list("".join(text.split()))


def _result(rec: StreamRecord, t: float, response) -> None:
    for r in response.results:
        if r.is_final:
            text = r.alternatives[0].transcript
            rec.finals.append({"token_ids": characters(text), "text": text, "recv": t})
            rec.final_recv = t
        else:
            rec.partials.append((t, r.audio_processed, 0.0, 0.0))
