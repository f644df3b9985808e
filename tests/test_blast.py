"""benchmarks/blast.py, the cheap paced sender of packet_cost_streams.py --client blast (issue 48):
its frames are what a real WebSocket parser reads as the intended payloads, its schedule sends every
packet of every stream once and in order, and the pacer writes exactly those bytes, on time."""

import base64
import json
import socket
import time

import numpy as np
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

from benchmarks import blast
from benchmarks.load_realtime import as_pcm16


def _parse(data: bytes) -> list[Frame]:
    """Client frames through websockets' own parser, as a server reads them (masked)."""
    reader = StreamReader()
    reader.feed_data(data)
    frames = []
    while reader.buffer:
        parser = Frame.parse(reader.read_exact, mask=True, max_size=None)
        try:
            next(parser)
        except StopIteration as done:
            frames.append(done.value)
    return frames


def _audio(seconds: float = 0.1) -> np.ndarray:
    return np.random.default_rng(3).uniform(-0.5, 0.5, int(16000 * seconds)).astype(np.float32)


def test_ws_frames_carry_each_packets_float32_samples():
    audio = _audio()
    frames = _parse(b"".join(blast.packet_frames(audio, "ws", 5)))
    assert [f.opcode for f in frames] == [Opcode.BINARY] * 5
    for k, f in enumerate(frames):
        assert f.fin and bytes(f.data) == audio[k * 320 : (k + 1) * 320].tobytes()


def test_realtime_frames_are_appends_of_base64_pcm16():
    audio = _audio()
    frames = _parse(b"".join(blast.packet_frames(audio, "realtime", 5)))
    for k, f in enumerate(frames):
        msg = json.loads(bytes(f.data))
        assert f.opcode == Opcode.TEXT and msg["type"] == "input_audio_buffer.append"
        assert base64.b64decode(msg["audio"]) == as_pcm16(audio[k * 320 : (k + 1) * 320]).tobytes()


def test_realtime24k_frames_are_appends_of_24_khz_pcm16_the_sdks_shape():
    """The OpenAI SDK's shape: 20 ms an append at 24 kHz (480 samples, 960 bytes), the items'
    16 kHz audio resampled once; the plan still counts 16 kHz samples (320 a packet)."""
    audio = _audio()
    frames = _parse(b"".join(blast.packet_frames(audio, "realtime24k", 5)))
    wire = np.concatenate([np.frombuffer(base64.b64decode(json.loads(bytes(f.data))["audio"]), "<i2") for f in frames])
    assert [f.opcode for f in frames] == [Opcode.TEXT] * 5
    assert all(json.loads(bytes(f.data))["type"] == "input_audio_buffer.append" for f in frames)
    assert len(wire) == 5 * 480 and np.array_equal(wire, as_pcm16(blast.at_sdk_rate(audio, 5 * 320)))
    back = wire.astype(np.float32)[::3] / 32768  # every third 24 kHz sample is a 16 kHz instant
    assert np.corrcoef(back[10:-10], audio[::2][10 : len(back) - 10])[0, 1] > 0.9
    assert blast.wire_of("realtime24k") == "realtime" and blast.end_frame("realtime24k") == blast.end_frame("realtime")


def test_the_plan_sends_every_packet_once_in_order_spread_over_the_interval():
    plan = blast.make_plan(num_streams=23, num_packets=4)
    assert plan.groups == 10  # 20 ms packets, a tick every 2 ms
    seen = {}
    for tick in range(plan.num_ticks()):
        for i in plan.streams_of(tick):
            j = len(seen.setdefault(i, []))
            assert plan.tick_of(i, j) == tick
            seen[i].append(tick)
    assert sorted(seen) == list(range(23)) and all(len(t) == 4 for t in seen.values())
    assert all(np.all(np.diff(t) == plan.groups) for t in seen.values())  # one packet a stream every 20 ms
    assert len({len(list(plan.streams_of(t))) for t in range(plan.groups)}) == 2  # 23 over 10 ticks: 2 or 3 each
    assert abs(plan.due_s(plan.tick_of(4, 3)) - plan.due_s(plan.tick_of(4, 2)) - 0.02) < 1e-12
    few = blast.make_plan(num_streams=3, num_packets=4)  # fewer streams than ticks: still 20 ms a packet
    assert few.groups == 3 and abs(few.due_s(few.tick_of(1, 2)) - few.due_s(few.tick_of(1, 1)) - 0.02) < 1e-12


def test_split_frames_keeps_an_unfinished_frame():
    long = b"x" * 300  # a 16-bit length
    data = blast.server_frame(b'{"type":"partial"}') + blast.server_frame(long)
    frames, rest = blast.split_frames(data[:-5])
    assert frames == [(1, b'{"type":"partial"}')] and rest == data[20:-5]
    frames, rest = blast.split_frames(rest + data[-5:])
    assert frames == [(1, long)] and rest == b""


def test_the_pacer_writes_each_streams_frames_in_order_and_on_time():
    audio = _audio(0.08)
    frames = [blast.packet_frames(audio, "ws", 4), blast.packet_frames(audio[::-1].copy(), "ws", 4)]
    pairs = [socket.socketpair() for _ in range(3)]
    for mine, _ in pairs:
        mine.setblocking(False)
    item_of = [0, 1, 0]
    plan = blast.make_plan(3, 4)
    pacer = blast.Pacer([mine for mine, _ in pairs], item_of, frames, plan, "ws")
    pairs[1][1].sendall(blast.server_frame(b'{"type":"ready"}'))  # a server message, kept for the parse
    t0 = time.time() + 0.01
    sent = pacer.run(t0)
    for i, (_, theirs) in enumerate(pairs):
        theirs.setblocking(False)
        assert theirs.recv(1 << 20) == b"".join(frames[item_of[i]])
    assert sent.short_sends == 0
    due = t0 + plan.due_s(np.arange(plan.num_ticks()))
    assert np.all(sent.tick_end >= due)  # never early
    assert [i for _, i, data in sent.received if data] == [1]
    for pair in pairs:
        for s in pair:
            s.close()


def test_grpc_frames_and_server_bytes_round_trip():
    """--client blast's gRPC streams (blast_grpc.py): each packet is one DATA frame on stream 1
    holding a StreamingRecognizeRequest of the packet's PCM16; the server's bytes, cut anywhere
    and parsed after the run, give the record its partials, its finals' characters and `done` at
    grpc-status 0 (an error status is the record's error). Seen failing with read_stream taking
    one gRPC message per DATA frame (the second result of a frame lost)."""
    import hpack
    import pytest

    riva = pytest.importorskip("riva.client.proto.riva_asr_pb2")
    from benchmarks import blast_grpc
    from benchmarks.load_level import StreamRecord
    from nemo_serve.server import h2_frames

    audio = _audio()
    frames = blast.packet_frames(audio, "grpc", 5)
    for k, f in enumerate(frames):
        assert f[3] == h2_frames.DATA and int.from_bytes(f[5:9], "big") == 1 and int.from_bytes(f[:3], "big") == len(f) - 9
        request = riva.StreamingRecognizeRequest.FromString(f[9 + 5 :])
        assert request.audio_content == as_pcm16(audio[k * 320 : (k + 1) * 320]).tobytes()

    def response(text: str, final: bool, processed: float) -> bytes:
        alt = riva.SpeechRecognitionAlternative(transcript=text)
        r = riva.StreamingRecognizeResponse(results=[riva.StreamingRecognitionResult(
            alternatives=[alt], is_final=final, audio_processed=processed)])  # fmt: skip
        data = r.SerializeToString()
        return b"\0" + len(data).to_bytes(4, "big") + data

    enc = hpack.Encoder()
    head = h2_frames.frame(h2_frames.HEADERS, h2_frames.END_HEADERS, 1, enc.encode([(":status", "200")]))
    data = h2_frames.frame(h2_frames.DATA, 0, 1, response("a b", False, 0.32) + response("a b c", True, 0.64))
    for status, done in (("0", True), ("8", False)):
        trailers = h2_frames.frame(h2_frames.HEADERS, 5, 1, hpack.Encoder().encode([("grpc-status", status)]))
        wire = h2_frames.frame(h2_frames.SETTINGS, 0, 0) + head + data + trailers
        rec = StreamRecord(0, "x", 1.0)
        blast_grpc.read_stream(rec, [(1.0, wire[:20]), (2.0, wire[20:47]), (3.0, wire[47:])])
        assert [p[1] for p in rec.partials] == [pytest.approx(0.32)]
        assert [f["token_ids"] for f in rec.finals] == [["a", "b", "c"]]  # characters, spaces dropped
        assert rec.done is done and (rec.error is None) is done


def test_packets_of_80_ms_the_target_shape_of_issue_48_item_4():
    plan = blast.make_plan(num_streams=100, num_packets=3, packet_samples=1280)
    assert (plan.groups, plan.packet_samples) == (40, 1280) and abs(plan.tick_s - 0.002) < 1e-12
    frames = _parse(b"".join(blast.packet_frames(_audio(0.24), "ws", 3, 1280)))
    assert [len(f.data) for f in frames] == [1280 * 4] * 3
