"""Clients for tests/test_hostile_grpc.py: request builders, the seeded fuzz's mutations and random
field values, the churn clients (hand-made HTTP/2 connections cut anywhere, grpc calls left while
the server sends) and the well-behaved riva.client neighbour, and the server's memory read from /proc."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from pathlib import Path

import grpc
import riva.client as riva
from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_asr_pb2_grpc as rasr_grpc

import nemo_serve

from .helpers_server import TOKEN

UTTERANCES = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))
SERVICE = "/nvidia.riva.asr.RivaSpeechRecognition/"
METADATA = (("authorization", f"Bearer {TOKEN}"),)
SHORT = b"\x01\x00" * 1600  # 0.1 s of PCM16 at 16 kHz


# ----------------------------------------------------------------------------- requests and the server's memory


def wav_header(rate: int, channels: int = 1, bits: int = 16, tag: int = 1, data_bytes: int = 0) -> bytes:
    """A canonical 44-byte RIFF/WAVE header."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block & 0xFFFFFFFF, block & 0xFFFF, bits)
    return (b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", data_bytes))  # fmt: skip


def config(**fields) -> rasr.RecognitionConfig:
    fields.setdefault("encoding", riva.AudioEncoding.LINEAR_PCM)
    return rasr.RecognitionConfig(**fields)


def streaming(audio: list[bytes], interim: bool = False, **fields) -> list:
    first = rasr.StreamingRecognizeRequest(streaming_config=rasr.StreamingRecognitionConfig(
        config=config(**fields), interim_results=interim))  # fmt: skip
    return [first, *(rasr.StreamingRecognizeRequest(audio_content=a) for a in audio)]


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError | None:
    try:
        out = fn(*args, **kwargs)
        if not isinstance(out, rasr.RecognizeResponse):
            list(out)
    except grpc.RpcError as e:
        return e
    return None


def tree_pids(pid: int) -> list[int]:
    """The server's processes: the supervisor and every descendant (front end, engine core)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(x) for x in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return pids


def memory_mb(server, field: str = "VmRSS") -> float:
    """Summed over the server's processes; VmHWM is each process's peak resident size."""
    total_kb = 0
    for pid in tree_pids(server.proc.pid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total_kb += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total_kb / 1024


# ----------------------------------------------------------------------------- the seeded fuzz's inputs


def mutate(rng: random.Random, data: bytes) -> bytes:
    """Bit flips, cuts, inserted and duplicated spans of a valid serialized request."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind, at = rng.randrange(4), rng.randrange(len(data) + 1)
        if kind == 0 and data:
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del data[at:]
        elif kind == 2:
            data[at:at] = rng.randbytes(rng.randint(1, 12))
        else:
            data[at:at] = data[at : at + rng.randint(1, 20)]
    return bytes(data)


def raw_request(rng: random.Random) -> bytes:
    if rng.random() < 0.3:
        return rng.randbytes(rng.randint(0, 64))
    valid = rng.choice([streaming([])[0], rasr.StreamingRecognizeRequest(audio_content=SHORT[:64]),
                        rasr.RecognizeRequest(config=config(sample_rate_hertz=8000), audio=SHORT[:64])])  # fmt: skip
    return mutate(rng, valid.SerializeToString())


def status_code(call) -> grpc.StatusCode:
    e = rpc_error(call)
    return grpc.StatusCode.OK if e is None else e.code()


def outcome(call) -> str:
    e = rpc_error(call)
    if e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no free slot" in e.details():
        return "BUSY"
    return "OK" if e is None else e.code().name


def random_config(rng: random.Random, served: list[str]) -> rasr.RecognitionConfig:
    def pick(good: list, bad: list):  # each field bad one time in eight, so some calls pass
        return rng.choice(bad if rng.random() < 0.125 else good)

    fields = {
        "encoding": pick([0, 1], [2, 3, 4, 5, 6, -1, 2**31 - 1]),
        "sample_rate_hertz": pick([0, 16000, 8000, 44100, 192000], [1, 7999, 192001, -1, 2**31 - 1]),
        "audio_channel_count": pick([0, 1, -1], [2, 2**31 - 1]),
        "language_code": pick(["", "en-US", "xx", "\x1b[31m", "9" * 5000], [""]),  # no prompts: ignored
        "model": pick(["", *served], ["no-such-model", "\0" * 100, "m" * 5000]),
        "max_alternatives": rng.choice([0, 1, 5, -1]),
        "enable_word_time_offsets": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        fields["endpointing_config"] = rasr.EndpointingConfig(stop_history=pick([0, 160], [-1, 2**31 - 1, 3_600_001]))
    if rng.random() < 0.3:
        phrases = [pick(["hello", "ok go"], ["", " ", "a" * 80, "\u4e2d"]) for _ in range(rng.randint(0, 4))]
        boost = pick([0.0, 2.0], [-4.0, 20.0, float("nan"), float("inf")])
        fields["speech_contexts"] = [rasr.SpeechContext(phrases=phrases, boost=boost)]
    return rasr.RecognitionConfig(**fields)


def random_audio(rng: random.Random) -> list[bytes]:
    chunks = [rng.choice([SHORT, SHORT, b"", SHORT[:3], rng.randbytes(rng.randint(0, 700))]) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.3:
        header = wav_header(rng.choice([16000, 16000, 1, 3, 0, 2**32 - 1]), rng.choice([1, 1, 2]), rng.choice([16, 16, 8]))
        chunks.insert(0, header)
    return chunks


# ----------------------------------------------------------------------------- churn clients and the neighbour

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def h2_open_stream() -> bytes:
    """Preface, empty SETTINGS, and HEADERS opening StreamingRecognize on stream 1, hand-made
    (HPACK literals without indexing), so the bytes after them can be cut anywhere."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", SERVICE + "StreamingRecognize"),
               (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers"),
               ("authorization", f"Bearer {TOKEN}")]  # fmt: skip
    block = b"".join(b"\x00" + bytes([len(n)]) + n.encode() + bytes([len(v)]) + v.encode() for n, v in headers)
    return PREFACE + h2_frame(4, 0, 0, b"") + h2_frame(1, 0x4, 1, block)


def grpc_message(request) -> bytes:
    data = request.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def pcm_of(wav: Path) -> bytes:
    return wav.read_bytes()[44:]


def raw_churn(server, cut: str, rst: bool) -> None:
    """A client that opens a stream by hand, sends 2 s of audio, reads what the server sends,
    then leaves mid-message (`cut`) with a FIN or an RST."""
    pcm = pcm_of(UTTERANCES[5])[:64000]
    body = grpc_message(streaming([], interim=True)[0]) + b"".join(
        grpc_message(rasr.StreamingRecognizeRequest(audio_content=pcm[i : i + 6400])) for i in range(0, len(pcm), 6400))
    sock = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5)
    try:
        if cut == "preface":
            sock.sendall(PREFACE[:11])
        else:
            sock.sendall(h2_open_stream())
            if cut != "headers":
                for i in range(0, len(body), 16384):
                    sock.sendall(h2_frame(0, 0, 1, body[i : i + 16384]))
                sock.settimeout(2)
                with contextlib.suppress(OSError):
                    sock.recv(65536)  # the server's SETTINGS, then its responses: it is sending
                half = {"message": h2_frame(0, 0, 1, b"\x00\x00\x00\x0c\x80" + b"\x1a"),  # says 3200 bytes, sends 1
                        "frame": h2_frame(0, 0, 1, b"\x00" * 16384)[:60]}[cut]  # fmt: skip
                sock.sendall(half)
        time.sleep(0.2)
    finally:
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def endless(stop: threading.Event, pace_s: float):
    """A streaming call with partials on that never ends its input by itself (the server's
    --max-stream-s does, after 8 s of audio)."""
    yield from streaming([], interim=True)
    pcm = pcm_of(UTTERANCES[7]) * 4
    for i in range(0, len(pcm), 3200):
        if stop.is_set():
            return
        yield rasr.StreamingRecognizeRequest(audio_content=pcm[i : i + 3200])
        time.sleep(pace_s)


def grpc_churn(server, how: str) -> grpc.StatusCode:
    """Leave a streaming call while the server is sending partials: cancel it, close its channel
    under it, or let its deadline expire. The code the client saw."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    stop = threading.Event()
    try:
        stub = rasr_grpc.RivaSpeechRecognitionStub(channel)
        call = stub.StreamingRecognize(endless(stop, 0.05), metadata=METADATA, timeout=1.5 if how == "deadline" else 30)
        try:
            next(call)  # a response arrived: the server is sending
        except grpc.RpcError as e:  # the deadline came first (a slow machine): still a deadline expiry
            return e.code()
        if how == "cancel":
            call.cancel()
        elif how == "close":
            channel.close()
        return status_code(lambda: list(call))
    finally:
        stop.set()
        channel.close()


def finals_with_words(responses) -> list[tuple]:
    return [(r.alternatives[0].transcript, [(w.word, w.start_time, w.end_time) for w in r.alternatives[0].words])
            for response in responses for r in response.results if r.is_final]  # fmt: skip


def neighbour(server, wav: Path, paced: bool, options: list | None = None, idle_s: float = 0) -> list[tuple]:
    """A well-behaved client, riva.client unchanged: the file at real-time pace (or at once), on a
    channel with grpcio `options`, connected `idle_s` before the call."""
    auth = riva.Auth(uri=f"127.0.0.1:{server.grpc_port}", metadata_args=[list(METADATA[0])], options=options or [])
    service = riva.ASRService(auth)
    try:
        if idle_s:
            grpc.channel_ready_future(auth.channel).result(timeout=10)
            time.sleep(idle_s)
        cfg = riva.StreamingRecognitionConfig(config=riva.RecognitionConfig(
            encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US", enable_word_time_offsets=True),
            interim_results=True)  # fmt: skip
        riva.add_audio_file_specs_to_config(cfg, wav)
        with riva.AudioChunkFileIterator(str(wav), 1600, riva.sleep_audio_length if paced else None) as chunks:
            return finals_with_words(service.streaming_response_generator(chunks, cfg))
    finally:
        service.auth.channel.close()
