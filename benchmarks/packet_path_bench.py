"""A paced packet's path inside one front-end process, no sockets (issue 48): the microseconds of
the audio decode, the ring write, and the whole frame hand-over (ws_socket.WsSocket.take_frame, or
RivaCall.push) per 20 ms packet.

    python benchmarks/packet_path_bench.py --out benchmarks/results/packet_path_cpu.json

Paths: /ws s16 (640 bytes), /ws f32 (1,280 bytes), /v1/realtime `input_audio_buffer.append` (20 ms
at 24 kHz, base64 in JSON, resampled to 16 kHz, turn_detection null), Riva 16 kHz bytes. Parts:
  decode     AudioDecoder.decode of the packet's PCM (realtime: base64 already decoded)
  ring       EngineClient.push of 320 float32 samples into a shared-memory ring (positions in
             shared memory, as on x86-64 servers)
  take_frame the transport's hand-over of one frame: session, parse, decode, ring, position
  render     one /v1/realtime partial rendered (OpenAIRenderer.render: item id, delta, JSON)
  uvicorn    the same hand-over from the bytes of one masked frame: uvicorn's WebSocket protocol
             (server/uvicorn_protocols.py, after a real upgrade) parses it and hands it to the
             socket's take_frame, as --port does (the frame parsing is the part its trees differ in)
  floor      a sketch, not the server's code: PCM16 scaled straight into the ring slice, what a
             decode fused with the ring write would cost (decode + ring apart: the gap)
The engine client is real (SharedSlots, the slot table, publish_write) but has no core: between
timed batches a stand-in core marks everything read (ring space and the session's backlog), out
of the timing. Each figure is the median over `--repeats` of the mean of `--packets` calls.
Run it on two trees side by side (`--tree` puts that tree first on sys.path) for a comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

BATCH = 50  # packets between two catch-ups of the stand-in core: 1 s of audio, half a 2 s ring
RATE = 16000
PACKET_S = 0.02


def _import_tree(tree: str | None) -> None:
    if tree:
        sys.path.insert(0, str(Path(tree).resolve()))


def _engine(num_slots: int = 8):
    import numpy as np  # noqa: F401

    from nemo_serve.core.client import EngineClient
    from nemo_serve.core.group import EngineGroup
    from nemo_serve.core.shared import SERVING, FileLock, SharedLayout, SharedSlots
    from nemo_serve.engine.geometry import ChunkGeometry, ModelInfo

    g = ChunkGeometry(context_left=56, context_right=3, first_frames=25, chunk_frames=32, pre_cache_frames=9,
                      drop_frames=2, min_first_frames=1, min_later_frames=8, hop_samples=160, sample_rate=RATE,
                      subsampling=8)  # fmt: skip
    info = ModelInfo(name="m", geometry=g, vocabulary=[], is_bpe=True, prompt_dictionary=None,
                     default_language=None, feature_margin=240, summary="")  # fmt: skip
    ipc_dir = tempfile.mkdtemp(prefix="ns-packet-path-")
    shared = SharedSlots.create(SharedLayout(num_slots, 2 * RATE, True), FileLock(f"{ipc_dir}/lock"))
    shared.state[0] = SERVING
    client = EngineClient(info, shared, 0, ipc_dir)  # not started: no ZMQ, no core
    return EngineGroup([client], [SimpleNamespace(index=0, device="cpu", pid=0)])  # as a front end has it


def _context(engine):
    from nemo_serve.compose import server_context
    from nemo_serve.config import Settings

    return server_context(engine, Settings.from_sources({}, {}))


class _FakeWs:
    """What WsSocket reads of a Starlette WebSocket outside run()."""

    def __init__(self, query: dict) -> None:
        self.query_params, self.headers, self.scope = query, {}, {}


def _catch_up(engine, sessions) -> None:
    """The stand-in core: every ring read to its end, every session's audio consumed."""
    for client in engine.clients:
        for h in list(client._streams.values()):
            h.read = h.written
            client.shared.read_end[h.slot] = h.written
    for s in sessions():
        s.processed_s = s.pushed_s


def _time_calls(call, packets: int, catch_up) -> float:
    """Mean microseconds of this thread's CPU per call over `packets` calls, in batches with
    catch-ups between. CPU, not wall time: on a shared machine a preemption inside a batch would
    add its whole time slice (runs of 2 and 14 us for the same ring write, wall-clock)."""
    spent = 0
    done = 0
    while done < packets:
        n = min(BATCH, packets - done)
        t0 = time.thread_time_ns()
        for _ in range(n):
            call()
        spent += time.thread_time_ns() - t0
        done += n
        catch_up()
    return spent / packets / 1000


def _pcm(n: int, dtype: str, seed: int = 0) -> bytes:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32) * 0.1
    return (x * 32767).astype("<i2").tobytes() if dtype == "s16" else x.astype("<f4").tobytes()


# ----------------------------------------------------------------------------- parts
def part_decode(encoding: str, rate: int):
    from nemo_serve.server.audio import AudioDecoder

    d = AudioDecoder(encoding, rate, RATE)
    data = _pcm(int(rate * PACKET_S), "s16" if encoding == "pcm_s16le" else "f32")
    return lambda: d.decode(data), lambda: None


def part_ring():
    import numpy as np

    engine = _engine()
    h = engine.open_stream(lambda r: None)
    samples = np.random.default_rng(1).standard_normal(int(RATE * PACKET_S)).astype(np.float32)
    return lambda: engine.push(h, samples), lambda: _catch_up(engine, lambda: ())


def part_floor_s16():
    """Not the server's path: a sketch of a PCM16 packet decoded straight into its ring slice (no
    float32 array of its own) with the same slot check and position store, for what such a fused
    path (decoder -> engine client) would save; both trees run the same code."""
    import numpy as np

    engine = _engine()
    client = engine.clients[0]
    h = engine.open_stream(lambda r: None)
    shared, size, scale = client.shared, client.shared.ring_samples, np.array(1 / 32768, np.float32)
    data, i16 = _pcm(int(RATE * PACKET_S), "s16"), np.dtype("<i2")

    def call():
        if not client._holds_slot(h):
            return
        pcm = np.frombuffer(data, i16)
        i, n = h.written % size, len(pcm)
        view = shared.ring[h.slot][i : i + n]  # the batches never wrap: 16000 of 32000 samples
        view[...] = pcm
        np.multiply(view, scale, out=view)
        h.written += n
        shared.publish_write(h.slot, h.gen, h.written, time.time())

    def catch_up():
        h.written = h.read = 0

    return call, catch_up


# ----------------------------------------------------------------------------- whole paths
def path_ws(encoding: str):
    from nemo_serve.server.ws_socket import WsSocket

    engine = _engine()
    sock = WsSocket(_FakeWs({"encoding": encoding}), _context(engine))
    sock._reading = True  # as when the receive task is parked in receive()
    data = _pcm(int(RATE * PACKET_S), "s16" if encoding == "pcm_s16le" else "f32")
    assert sock.take_frame(data) and sock.session.streaming, "the stream did not open"
    return _Call(sock, data), lambda: _catch_up(engine, lambda: (sock.session,))


def path_realtime():
    from nemo_serve.server.realtime import realtime_wire
    from nemo_serve.server.ws_socket import WsSocket

    engine = _engine()
    sock = WsSocket(_FakeWs({}), _context(engine), realtime_wire)
    sock._reading = True
    update = {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None}}}}  # fmt: skip
    assert sock.take_frame(json.dumps(update))
    audio = base64.b64encode(_pcm(int(24000 * PACKET_S), "s16")).decode()
    frame = json.dumps({"type": "input_audio_buffer.append", "audio": audio})
    assert sock.take_frame(frame) and sock.wire.items, "no item opened"

    def sessions():
        return [i.session for i in sock.wire.items if i.session is not None]

    return _Call(sock, frame), lambda: _catch_up(engine, sessions)


def path_riva():
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.server.riva_grpc import RivaCall
    from nemo_serve.server.riva_mapping import RivaConfig

    engine = _engine()
    call = RivaCall(_context(engine), None)
    config = RivaConfig(sample_rate=RATE, language=None, context_right=None, endpoint=EndpointConfig(),
                        interim_results=True, word_time_offsets=False)  # fmt: skip
    assert call.open(config), "the call was refused"
    data = _pcm(int(RATE * PACKET_S), "s16")
    return lambda: call.push(data), lambda: _catch_up(engine, lambda: (call.session,))


def _masked_frame(payload: bytes, opcode: int) -> bytes:
    """A client's frame: FIN, the opcode, the mask bit, the length, a masking key, the payload masked."""
    import numpy as np

    n = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    mask = b"\x1b\x2c\x3d\x4e"
    body = np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)
    return head + mask + body.tobytes()


def _uvicorn_protocol(take_frame):
    """uvicorn's WebSocket protocol of --port after a real upgrade, accepted, its frames handed to
    `take_frame`; the transport a stand-in that keeps nothing."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from nemo_serve.server.connections import ConnectionLimits
    from nemo_serve.server.uvicorn_protocols import protocol_classes

    async def app(scope, receive, send):  # never run while timed: the handshake is completed below
        return None

    limiter = SimpleNamespace(metrics=None, acquire=lambda *a: None, release=lambda *a: None)
    config = Config(app, ws_max_size=1 << 20, ws_per_message_deflate=False, log_level="warning")
    config.load()
    _, ws_class = protocol_classes(ConnectionLimits(limiter, 5.0))
    proto = ws_class(config, ServerState(), {})
    peer = {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}
    proto.connection_made(SimpleNamespace(get_extra_info=lambda k, d=None: peer.get(k, d), write=lambda b: None,
                                          is_closing=lambda: False, close=lambda: None,
                                          pause_reading=lambda: None, resume_reading=lambda: None))  # fmt: skip
    proto.data_received(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip
    assert proto.queue.get_nowait() == {"type": "websocket.connect"}  # the app's first receive takes it
    proto.conn.send_response(proto.response)  # what the app's websocket.accept does (uvicorn's send)
    proto.conn.data_to_send()
    proto.handshake_complete = True
    proto._take_frames(take_frame)
    return proto


def path_uvicorn_ws(encoding: str):
    call, catch_up = path_ws(encoding)
    sock, data = call.sock, call.data
    proto = _uvicorn_protocol(sock.take_frame)
    wire = _masked_frame(data, 0x2)
    proto.data_received(wire)
    assert proto.queue.empty(), "the frame was queued, not handed over"
    return lambda: proto.data_received(wire), catch_up


def path_uvicorn_realtime():
    call, catch_up = path_realtime()
    proto = _uvicorn_protocol(call.sock.take_frame)
    wire = _masked_frame(call.data.encode(), 0x1)
    proto.data_received(wire)
    assert proto.queue.empty(), "the frame was queued, not handed over"
    return lambda: proto.data_received(wire), catch_up


class _Call:
    """A timed call that also says what it calls (the uvicorn cases reuse a path's socket and packet)."""

    def __init__(self, sock, data) -> None:
        self.sock, self.data = sock, data

    def __call__(self):
        return self.sock.take_frame(self.data)


def part_render_realtime_delta():
    """One partial through /v1/realtime's renderer (OpenAIRenderer.render: the item's id, the
    delta event, its JSON), the text growing by a word per result as a partial's does; the
    renderer's memory of sent text is reset between batches (the catch-up)."""
    from types import SimpleNamespace as NS

    from nemo_serve.engine.results import StreamResult
    from nemo_serve.server.realtime_render import OpenAIRenderer

    item = NS(start_s=0.0)
    items = NS(keys=NS(key_to_stream={0: item}), vad=None, rt=NS(turn_detection=None))
    renderer = OpenAIRenderer(items)
    texts = [" ".join(["word"] * k) for k in range(1, BATCH + 1)]
    results = [StreamResult("s", t, 0, False, [1], [1] * k, [0.1] * k, 0.0, 1.0, 0.0) for k, t in enumerate(texts, 1)]
    state = {"k": 0}

    def call():
        renderer.render(results[state["k"]])
        state["k"] += 1

    def catch_up():
        state["k"] = 0
        renderer.sent_text.clear()

    return call, catch_up


CASES = {
    "decode_ws_s16": lambda: part_decode("pcm_s16le", RATE),
    "decode_ws_f32": lambda: part_decode("pcm_f32le", RATE),
    "decode_realtime_24k": lambda: part_decode("pcm_s16le", 24000),
    "ring_write": part_ring,
    "floor_s16_into_ring": part_floor_s16,
    "take_frame_ws_s16": lambda: path_ws("pcm_s16le"),
    "take_frame_ws_f32": lambda: path_ws("pcm_f32le"),
    "take_frame_realtime_24k": path_realtime,
    "push_riva_16k": path_riva,
    "render_realtime_delta": part_render_realtime_delta,
    "uvicorn_frame_ws_s16": lambda: path_uvicorn_ws("pcm_s16le"),
    "uvicorn_frame_ws_f32": lambda: path_uvicorn_ws("pcm_f32le"),
    "uvicorn_frame_realtime_24k": path_uvicorn_realtime,
}


async def _measure(names, packets: int, repeats: int) -> dict:
    out = {}
    for name in names:
        call, catch_up = CASES[name]()
        _time_calls(call, packets // 4, catch_up)  # warm up
        runs = [_time_calls(call, packets, catch_up) for _ in range(repeats)]
        out[name] = {"us_per_packet": round(statistics.median(runs), 3), "runs_us": [round(r, 3) for r in runs]}
        print(f"{name:26s} {out[name]['us_per_packet']:8.2f} us  (runs {out[name]['runs_us']})", flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="a source tree to measure (repeatable; "
                   "default: the one imported); each runs in its own process, alternately, --rounds times")  # fmt: skip
    p.add_argument("--label", action="append", default=[], help="a name per --tree")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--packets", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2, help="with --tree: alternations of the trees")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--notes", default=None)
    p.add_argument("--out")
    args = p.parse_args(argv)
    names = args.cases.split(",")
    if args.child or not args.tree:
        import logging

        import torch

        torch.set_num_threads(1)
        logging.disable(logging.INFO)
        result = asyncio.run(_measure(names, args.packets, args.repeats))
        if args.child:
            print("RESULT " + json.dumps(result))
        return result
    return _side_by_side(args, names)


def _side_by_side(args, names) -> dict:
    import subprocess

    labels = args.label or [Path(t).name for t in args.tree]
    per_tree: dict[str, list[dict]] = {lab: [] for lab in labels}
    for _ in range(args.rounds):
        for tree, lab in zip(args.tree, labels):
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--cases", ",".join(names),
                   "--packets", str(args.packets), "--repeats", str(args.repeats)]  # fmt: skip
            print(f"--- {lab}", flush=True)
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            print(out, end="")
            per_tree[lab].append(json.loads(out.split("RESULT ", 1)[1]))
    table = {lab: {n: round(statistics.median(r[n]["us_per_packet"] for r in rounds), 3) for n in names}
             for lab, rounds in per_tree.items()}  # fmt: skip
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import run_record

    result = {
        "run": {**run_record(), "notes": args.notes},
        "unit": "microseconds of the thread's CPU (thread_time) per 20 ms packet, one process, no sockets; median of rounds of medians",
        "trees": dict(zip(labels, args.tree)),
        "us_per_packet": table,
        "rounds": per_tree,
    }
    if len(labels) == 2:
        a, b = labels
        result["ratio"] = {n: round(table[b][n] / table[a][n], 3) for n in names}
    for n in names:
        print(f"{n:26s} " + "  ".join(f"{lab} {table[lab][n]:7.2f}" for lab in labels))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
