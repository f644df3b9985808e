"""Clients for tests/test_hostile_files.py: uploads (well-formed, raw on a socket, mutated by the seeded
fuzz, cut by churn), audio files built to be hostile (FLAC bombs, forged WAV headers), the /ws
neighbour stream that must not notice, and the front end's memory read from /proc."""

from __future__ import annotations

import asyncio
import io
import socket
import struct
import threading
import time

import httpx
import numpy as np
import soundfile

from nemo_serve.client import StreamingClient

from . import helpers
from .helpers_server import TOKEN

URL_PATH = "/v1/audio/transcriptions"


def post(server, files=None, data=None, content=None, headers=None, timeout_s: float = 60.0) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKEN}", **(headers or {})}
    return httpx.post(server.http_url + URL_PATH, files=files, data=data, content=content, headers=headers,
                      timeout=timeout_s, trust_env=False)  # fmt: skip


def rss_kb(pid: int, field: str = "VmHWM") -> int:
    """The front end's peak (VmHWM) or current (VmRSS) resident memory, kB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def wav_bytes(samples: np.ndarray, rate: int = 16000, fmt: str = "WAV", subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def silent_flac(seconds: int, channels: int, rate: int) -> bytes:
    """Silence in FLAC, written a few seconds at a time: a few hundred kB for many minutes."""
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as f:
        block = np.zeros((rate * 10, channels), dtype="int16")
        for _ in range(seconds // 10):
            f.write(block)
    return buf.getvalue()


class Neighbour:
    """A /ws stream at real-time pace (or `speed` times it) in its own thread: its message arrival
    times (to see an event-loop stall as a gap) and its final tokens (to compare with a quiet run)."""

    def __init__(self, server, seconds: float, seed: int = 3, context_right: int | None = None,
                 speed: float = 1.0) -> None:  # fmt: skip
        self.server, self.context_right, self.speed = server, context_right, speed
        self.pcm = (np.concatenate(helpers.utterances(int(seconds // 2) + 1, seed=seed))[: int(seconds * 16000)]
                    * 32767).astype("<i2")  # fmt: skip
        self.arrivals: list[float] = []
        self.tokens: list[int] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> "Neighbour":
        self.thread.start()
        time.sleep(1.0)  # streaming has begun
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the neighbour stream hung"

    async def _run(self) -> None:
        async with StreamingClient(self.server.ws_url, sample_rate=16000, encoding="pcm_s16le", token=TOKEN,
                                   context_right=self.context_right) as c:  # fmt: skip
            receiver = asyncio.create_task(self._receive(c))
            step = 1600
            due = time.monotonic()
            for i in range(0, len(self.pcm), step):
                await c.send_audio(self.pcm[i : i + step])
                due += step / 16000 / self.speed  # read each packet: hurry() takes effect at once
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            await c.end()
            await receiver

    async def _receive(self, c: StreamingClient) -> None:
        async for m in c.messages():
            self.arrivals.append(time.monotonic())
            if m["type"] == "final":
                self.tokens += m["token_ids"]

    def hurry(self, speed: float = 5.0) -> None:
        """The rest of the audio at `speed` times real time: the hostile work it had to stream beside
        is over, and its tokens do not depend on the pace."""
        self.speed = speed

    def max_gap_s(self) -> float:
        return float(np.max(np.diff(self.arrivals))) if len(self.arrivals) > 1 else float("inf")


NEIGHBOUR_S, NEIGHBOUR_SEED = 10, 9


def smallest_mode(server) -> int:
    return min(m["context_right"] for m in server.readyz()["modes"])


def paced_neighbour(server) -> Neighbour:
    return Neighbour(server, NEIGHBOUR_S, seed=NEIGHBOUR_SEED, context_right=smallest_mode(server))


def raw_send(port: int, payload: bytes, then: str = "wait", wait_s: float = 5.0) -> tuple[float, bytes]:
    """Send `payload` on a raw socket, then "wait" (read until closed), "fin" or "rst"; the
    seconds until the server closed and what it answered."""
    s = socket.create_connection(("127.0.0.1", port))
    try:
        s.sendall(payload)
        if then == "rst":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # l_onoff 1, l_linger 0
            return 0.0, b""
        if then == "fin":
            s.shutdown(socket.SHUT_WR)
        s.settimeout(wait_s)
        t0, reply = time.monotonic(), b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except (TimeoutError, ConnectionResetError):
            return wait_s, reply
        return time.monotonic() - t0, reply
    finally:
        s.close()


def upload_head(body_bytes: int, boundary: str = "XyZ", path: str = URL_PATH) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {body_bytes}\r\n\r\n").encode()  # fmt: skip


LISTEN_PATH = "/v1/listen"  # Deepgram's pre-recorded door: the raw file as the body


def listen(server, content, query: str = "", token: str = TOKEN, content_type: str = "audio/wav",
           timeout_s: float = 60.0) -> httpx.Response:  # fmt: skip
    """POST /v1/listen as Deepgram's clients do (`content`: bytes, or an iterator: sent chunked)."""
    headers = {"Authorization": f"Token {token}", "Content-Type": content_type}
    return httpx.post(server.http_url + LISTEN_PATH + query, content=content, headers=headers, timeout=timeout_s,
                      trust_env=False)  # fmt: skip


def listen_head(body_bytes: int, token: str = TOKEN) -> bytes:
    return (f"POST {LISTEN_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Token {token}\r\n"
            f"Content-Type: audio/wav\r\nContent-Length: {body_bytes}\r\n\r\n").encode()  # fmt: skip


def multipart(fields: dict, boundary: str = "XyZ") -> bytes:
    """{name: bytes or (filename, bytes, content_type)} -> a multipart body."""
    out = b""
    for name, value in fields.items():
        if isinstance(value, tuple):
            fname, data, ctype = value
            out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{fname}"\r\n'
                    f"Content-Type: {ctype}\r\n\r\n").encode() + data + b"\r\n"  # fmt: skip
        else:
            out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def http_on(s: socket.socket, path: str, method: str = "GET") -> int:
    """One keep-alive request on an open socket; its status (0 if the server closed instead)."""
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    s.settimeout(5)
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = s.recv(65536)
        if not chunk:
            break
        reply += chunk
    if not reply:
        return 0
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(next((h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), b"0"))
    while len(body) < length and (chunk := s.recv(65536)):
        body += chunk
    return int(head.split(b" ")[1])


def wav_header(rate: int = 16000, channels: int = 1, bits: int = 16, tag: int = 1, data_bytes: int | None = None,
                data: bytes = b"\0" * 3200) -> bytes:  # fmt: skip
    block = channels * bits // 8
    fmt_chunk = struct.pack("<4sIHHIIHH", b"fmt ", 16, tag, channels, rate, rate * block, block, bits)
    size = len(data) if data_bytes is None else data_bytes
    return b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + fmt_chunk + b"data" + struct.pack("<I", size) + data


def short_speech() -> np.ndarray:
    return (helpers.utterances(1, seed=11)[0][:8000] * 32767).astype("<i2")


def mutate(data: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(data)
    kind = rng.integers(6)
    if kind == 0:  # flip bytes, most often in the header
        for _ in range(int(rng.integers(1, 8))):
            b[int(rng.integers(min(len(b), 96 if rng.random() < 0.7 else len(b))))] = int(rng.integers(256))
    elif kind == 1:  # cut short
        del b[int(rng.integers(len(b))) :]
    elif kind == 2:  # insert noise
        at = int(rng.integers(len(b)))
        b[at:at] = rng.integers(0, 256, int(rng.integers(1, 300))).astype("u1").tobytes()
    elif kind == 3:  # a header field forged to an extreme
        at = int(rng.integers(0, max(1, min(len(b), 64) - 4)))
        b[at : at + 4] = int(rng.choice([0, 1, 0xFFFFFFFF, 0x7FFFFFFF, int(rng.integers(2**32))])).to_bytes(4, "little")
    elif kind == 4:  # a slice repeated
        at, n = int(rng.integers(len(b))), int(rng.integers(1, 2000))
        b[at:at] = b[at : at + n] * int(rng.integers(1, 4))
    else:  # zeroed run
        at, n = int(rng.integers(len(b))), int(rng.integers(1, 500))
        b[at : at + n] = bytes(len(b[at : at + n]))
    return bytes(b)


def fuzz(server, num: int, seed: int) -> dict[int, int]:
    """`num` mutated WAV / FLAC files and multipart bodies; status -> count."""
    rng = np.random.default_rng(seed)
    speech = short_speech()[:4800]
    stereo = np.stack([speech, speech[::-1]], axis=1)
    bases = [wav_bytes(speech), wav_bytes(stereo, 44100, "FLAC"), wav_bytes(speech, 8000, "WAV", "ULAW")]
    statuses: dict[int, int] = {}
    head = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.http_url, headers=head, timeout=30, trust_env=False) as client:
        for _ in range(num):
            audio = bases[int(rng.integers(len(bases)))]
            if rng.random() < 0.7:
                r = client.post(URL_PATH, files={"file": ("f", mutate(audio, rng), "audio/wav")})
            else:
                body = mutate(multipart({"file": ("f.wav", audio, "audio/wav"), "response_format": b"json"}), rng)
                r = client.post(URL_PATH, content=body, headers={"Content-Type": "multipart/form-data; boundary=XyZ"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                raise AssertionError(f"{r.status_code}: {r.text[:500]}")
    return statuses


def churn(server, num: int, seed: int) -> dict[str, int]:
    """Uploads that end every way a connection can: FIN or RST mid-body, RST or a close while the
    server transcribes, a body that stalls (one, it takes the 2 s deadline)."""
    rng = np.random.default_rng(seed)
    speech = np.concatenate(helpers.utterances(2, seed=seed))
    body = multipart({"file": ("a.wav", wav_bytes((speech * 32767).astype("<i2")), "audio/wav")})
    whole = upload_head(len(body)) + body
    half = whole[: len(whole) // 2]
    kinds = {"fin mid-body": (half, "fin"), "rst mid-body": (half, "rst"), "rst while answering": (whole, "rst"),
             "close while answering": (whole, "close")}  # fmt: skip
    done = {k: 0 for k in kinds} | {"stalled": 0}
    for _ in range(num):
        kind = list(kinds)[int(rng.integers(len(kinds)))]
        payload, how = kinds[kind]
        if how == "close":
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.sendall(payload)
                time.sleep(float(rng.uniform(0, 0.2)))
        else:
            raw_send(server.port, payload, then=how, wait_s=3)
        done[kind] += 1
    took_s, reply = raw_send(server.port, half)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    done["stalled"] += 1
    return done


def flac_of_unknown_length(seconds: int) -> bytes:
    """Silence in a FLAC whose STREAMINFO says 0 samples (legal: "unknown", as an encoder writing
    to a pipe leaves it); libsndfile then reports 2**63 - 1 frames."""
    data = bytearray(silent_flac(seconds, 1, 16000))
    assert data[:4] == b"fLaC"
    data[21] &= 0xF0  # the 36-bit total-samples field: the low 4 bits of byte 21, then bytes 22 to 25
    data[22:26] = bytes(4)
    return bytes(data)
