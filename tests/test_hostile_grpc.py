"""Riva gRPC (--grpc-port) under hostile clients (issue 45), as tests/test_hardening.py holds /ws:
a regression test per defect, scripted bad inputs, a seeded fuzz of raw request bytes and of
field values, churn (cancels, abrupt channel closes, half-sent streams, deadlines) while the
server is sending, a neighbour stream whose finals and word times must equal the same file's sent
alone (Riva's results carry text and word times, not token ids), and free slots and the server's
memory checked after. Every refusal must be INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for a full
server or grpc's message cap, CANCELLED / DEADLINE_EXCEEDED where the client asked for it): never
INTERNAL or UNKNOWN.

One server of its own (`--max-stream-s 8`, so the duration cap is reachable; no token, so every
request reaches its parsing: test_riva_grpc.py checks the token before it), NVIDIA's
`riva.client` where a client sends well-formed requests, a bare grpc channel where it must not
(the clients and request builders: helpers_hostile_grpc.py).
"""

from __future__ import annotations

import collections
import random
import threading
import time

import grpc
import pytest

from .helpers_server import free_port, start_server

riva = pytest.importorskip("riva.client")
from riva.client.proto import riva_asr_pb2 as rasr  # noqa: E402
from riva.client.proto import riva_asr_pb2_grpc as rasr_grpc  # noqa: E402

from .helpers_hostile_grpc import (METADATA, SERVICE, SHORT, UTTERANCES, config, grpc_churn, memory_mb,  # noqa: E402
                                   neighbour, outcome, raw_churn, raw_request, random_audio, random_config,
                                   rpc_error, streaming, wav_header)

NUM_SLOTS = 3
MAX_STREAM_S = 8


@pytest.fixture(scope="module")
def both_doors():
    """One server with both doors: grpc.aio (--grpc-port) and our HTTP/2 (--fast-grpc-port)."""
    ports = {"grpc_aio": free_port(), "fast_grpc": free_port()}
    with start_server("--grpc-port", str(ports["grpc_aio"]), "--fast-grpc-port", str(ports["fast_grpc"]),
                      "--num-slots", str(NUM_SLOTS), "--frontends", "1",
                      "--idle-timeout-s", "5", "--max-stream-s", str(MAX_STREAM_S), "--context-right", "all",
                      "--log-level", "info", token=None) as s:  # fmt: skip
        s.door_ports = ports
        yield s
    assert "Traceback" not in s.log(), s.log()[-4000:]


@pytest.fixture(scope="module", params=["grpc_aio", "fast_grpc"])
def server(both_doors, request):
    """The suite runs whole against each door (the tests see the door's port as `grpc_port`)."""
    both_doors.grpc_port = both_doors.door_ports[request.param]
    yield both_doors


@pytest.fixture
def channel(server):
    ch = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    yield ch
    ch.close()
    server.assert_no_leak()


@pytest.fixture
def stub(channel):
    return rasr_grpc.RivaSpeechRecognitionStub(channel)


# ----------------------------------------------------------------------------- defect 2: declared rates


def test_wav_header_rate_is_range_checked_before_decoding_recognize(server, stub):
    """Defect 2: with sample_rate_hertz 0, a 4 kB Recognize whose WAV header says 1 Hz became
    2,048 s of audio (+307 MB) before any limit was checked. Without the fix this call was not
    refused (it decoded, and the peak memory of the server grew by hundreds of MB)."""
    peak_before = memory_mb(server, "VmHWM")
    for rate in (1, 3, 7999, 192001, 0xFFFFFFFF):
        audio = wav_header(rate, data_bytes=4096) + b"\x01\x00" * 2048
        e = rpc_error(stub.Recognize, rasr.RecognizeRequest(config=config(), audio=audio), metadata=METADATA, timeout=20)
        assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (rate, e)
        assert f"WAV header says {rate} Hz" in e.details() and "8000" in e.details(), e.details()
    assert memory_mb(server, "VmHWM") - peak_before < 50
    server.assert_no_leak()


def test_wav_header_rate_is_range_checked_streaming_and_holds_no_slot(server, stub):
    """Defect 2: a 3 Hz header on StreamingRecognize held a slot for 1,365 s of audio. Without the
    fix the call was not refused: it ran into its 10 s deadline holding a slot."""
    release = threading.Event()

    def requests():
        yield from streaming([wav_header(3) + b"\x01\x00" * 2048])
        release.wait(10)  # keep input open: only the refusal may end the call

    t0 = time.monotonic()
    e = rpc_error(stub.StreamingRecognize, requests(), metadata=METADATA, timeout=10)
    release.set()
    assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    assert "WAV header says 3 Hz" in e.details() and time.monotonic() - t0 < 5
    server.assert_no_leak(timeout_s=2)


def test_audio_past_max_stream_s_is_never_decoded(server, stub):
    """The duration cap is computed from the declared rate and the byte count before decoding:
    one 1 MiB-ish message of 8 kHz PCM (60 s) on a server with --max-stream-s 8 decodes 8 s.
    Without the fix all 60 s went to the engine (audio_processed 60) before the cap was seen."""
    pcm = b"\x00\x00" * (8000 * 60)
    finals = []
    for response in stub.StreamingRecognize(iter(streaming([pcm], interim=True, sample_rate_hertz=8000)),
                                            metadata=METADATA, timeout=60):  # fmt: skip
        finals += [r for r in response.results]
    response = stub.Recognize(rasr.RecognizeRequest(config=config(sample_rate_hertz=8000), audio=pcm),
                              metadata=METADATA, timeout=60)  # fmt: skip
    processed = [r.audio_processed for r in [*finals, *response.results]]
    assert all(p <= MAX_STREAM_S + 1.2 for p in processed), processed
    server.assert_no_leak()


def test_a_header_of_many_small_chunks_is_read_once(server, stub):
    """A WAV header of 8,000 empty chunks (64 kB, under the header cap) sent 8 bytes a message:
    the header was re-read from its first chunk on every message, so its cost grew with the
    square of its size (4,000 chunks: 9 s of the front end's event loop; 8,000: about 40 s, every
    stream on that front end stalled). Without the fix the front end was still reading the header
    when the call's --max-stream-s (8 s of wall time) ran out: "the audio ended inside its WAV
    header" after 8 s, where it now ends OK in about 1.5 s."""
    header = wav_header(16000)[:36] + b"junk\0\0\0\0" * 8000 + b"data\0\0\0\0"
    pieces = [header[i : i + 8] for i in range(0, len(header), 8)]
    t0 = time.monotonic()
    responses = list(stub.StreamingRecognize(iter(streaming([*pieces, SHORT * 10])), metadata=METADATA, timeout=20))
    assert time.monotonic() - t0 < 15, responses
    server.assert_no_leak()


# ----------------------------------------------------------------------------- defect 9: errors in client terms


def test_corrupt_protobuf_is_invalid_argument_in_client_terms(server, channel):
    """Defect 9: a request that is not a protobuf was answered UNKNOWN with a Python class name."""
    unary = channel.unary_unary(SERVICE + "Recognize")
    stream = channel.stream_stream(SERVICE + "StreamingRecognize")
    first = streaming([])[0].SerializeToString()
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab"):
        for call, request in ((unary, garbage), (stream, iter([garbage])), (stream, iter([first, garbage]))):
            e = rpc_error(call, request, metadata=METADATA, timeout=10)
            assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (garbage, e)
            assert "not a valid" in e.details() and "Error" not in e.details() and "<" not in e.details(), e.details()


def test_unserved_encoding_is_named(server, stub):
    """Defect 9: "encoding 2 is not served" said a number where the client wrote FLAC."""
    for encoding, name in ((riva.AudioEncoding.FLAC, "FLAC"), (riva.AudioEncoding.MULAW, "MULAW"),
                           (riva.AudioEncoding.OGGOPUS, "OGGOPUS"), (77, "77")):  # fmt: skip
        e = rpc_error(stub.StreamingRecognize, iter(streaming([b"\0\0" * 160], encoding=encoding)), metadata=METADATA)
        assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"encoding {name} is not served" in e.details() and "LINEAR_PCM" in e.details(), e.details()


def test_client_values_are_cut_in_errors_and_unknown_model_lists_served(server, stub):
    """Defect 9: a client value was echoed whole (a 4,000-digit value in a 4.2 kB error)."""
    served = [c.model_name for c in stub.GetRivaSpeechRecognitionConfig(
        rasr.RivaSpeechRecognitionConfigRequest(), metadata=METADATA).model_config]  # fmt: skip
    assert len(served) >= 2
    for model in ("x" * 5000, "parakeet-1.1b-en-US-asr-streaming", "\x1b[31m\n" * 100):
        for call in (lambda: stub.Recognize(rasr.RecognizeRequest(config=config(model=model), audio=b"\0\0"),
                                            metadata=METADATA),  # fmt: skip
                     lambda: stub.StreamingRecognize(iter(streaming([b"\0\0"], model=model)), metadata=METADATA)):
            e = rpc_error(call)
            assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown model" in e.details() and all(name in e.details() for name in served), e.details()
            assert len(e.details()) < 300 + sum(map(len, served)) and "\x1b" not in e.details(), e.details()


# ----------------------------------------------------------------------------- scripted bad inputs

HEADER_CASES = {  # a WAV header at the start of the audio (sample_rate_hertz 0) -> what the reason says
    "3 Hz": (wav_header(3), "WAV header says 3 Hz"),
    "0 Hz": (wav_header(0), "WAV header says 0 Hz"),
    "4 GHz": (wav_header(0xFFFFFFFF), "outside the served"),
    "stereo": (wav_header(16000, channels=2), "2 channels"),
    "no channels": (wav_header(16000, channels=0), "0 channels"),
    "8-bit": (wav_header(16000, bits=8), "8-bit"),
    "float": (wav_header(16000, bits=32, tag=3), "format 3"),
    "short fmt": (b"RIFF\x24\0\0\0WAVEfmt \x04\0\0\0\x01\0\x01\0data\0\0\0\0", "fmt chunk too short"),
    "no data chunk": (b"RIFF\0\0\0\0WAVE" + b"LIST\xf0\xff\0\0" + b"\0" * 70_000, "without a data chunk"),
}


def bad_streams() -> dict[str, tuple[list, str]]:
    """name -> (StreamingRecognizeRequest list, a phrase of the INVALID_ARGUMENT reason)."""
    pb_audio = rasr.StreamingRecognizeRequest
    cases = {
        "encoding FLAC": (streaming([SHORT], encoding=riva.AudioEncoding.FLAC), "encoding FLAC"),
        "encoding ALAW": (streaming([SHORT], encoding=riva.AudioEncoding.ALAW), "encoding ALAW"),
        "encoding -3": (streaming([SHORT], encoding=-3), "encoding -3"),
        "rate 1": (streaming([SHORT], sample_rate_hertz=1), "sample_rate_hertz 1 Hz"),
        "rate -16000": (streaming([SHORT], sample_rate_hertz=-16000), "sample_rate_hertz -16000 Hz"),
        "rate 2^31-1": (streaming([SHORT], sample_rate_hertz=2**31 - 1), "outside the served"),
        "stereo": (streaming([SHORT], audio_channel_count=2), "audio_channel_count 2"),
        "model": (streaming([SHORT], model="nvidia/parakeet" * 100), "unknown model"),
        "stop_history": (streaming([SHORT], endpointing_config=rasr.EndpointingConfig(stop_history=-1)), "stop_history"),
        "boost NaN": (streaming([SHORT], speech_contexts=[rasr.SpeechContext(phrases=["a"], boost=float("nan"))]),
                      "speech_contexts: boost"),  # fmt: skip
        "header rate differs": (streaming([wav_header(8000) + SHORT], sample_rate_hertz=16000), "WAV header says 8000"),
        "odd bytes": (streaming([b"\0" * 321]), "2-byte samples"),
        "config twice": (streaming([SHORT]) + streaming([]), "only in the first message"),
        "audio before config": ([pb_audio(audio_content=SHORT), *streaming([SHORT])], "first message must carry"),
        "no messages": ([], "ended before its streaming_config"),
        "header cut": (streaming([wav_header(16000)[:30]]), "ended inside its WAV header"),
    }
    for name, (header, needle) in HEADER_CASES.items():
        cases[f"header {name}"] = (streaming([header[:7], header[7:], SHORT]), needle)  # split mid-header
    return cases


def test_scripted_bad_streams_are_invalid_argument(server, stub):
    for name, (requests, needle) in bad_streams().items():
        e = rpc_error(stub.StreamingRecognize, iter(requests), metadata=METADATA, timeout=10)
        assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e)
        assert needle in e.details() and len(e.details()) < 300, (name, e.details())
        server.assert_no_leak(timeout_s=5)  # a call refused after admission gives its slot back
    admitted = server.metric("nemo_serve_streams_total")
    for name, (header, needle) in HEADER_CASES.items():  # the same headers in Recognize, back to back
        e = rpc_error(stub.Recognize, rasr.RecognizeRequest(config=config(), audio=header + SHORT), metadata=METADATA,
                      timeout=10)  # fmt: skip
        assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e)
        assert needle in e.details(), (name, e.details())
    assert server.metric("nemo_serve_streams_total") == admitted, "Recognize checks its WAV header before it takes a slot"


def test_empty_chunks_and_oversized_messages(server, stub):
    """Empty audio messages are nothing (the call ends OK with no result); a message over
    --max-message-bytes is grpc's own RESOURCE_EXHAUSTED, unread, and ends only that call."""
    responses = list(stub.StreamingRecognize(iter(streaming([b""] * 200)), metadata=METADATA, timeout=10))
    assert [r for response in responses for r in response.results] == []
    big = b"\0\0" * (1 << 20)  # 2 MiB, over the default 1 MiB
    for call, request in ((stub.StreamingRecognize, iter(streaming([SHORT, big]))),
                          (stub.Recognize, rasr.RecognizeRequest(config=config(), audio=big))):  # fmt: skip
        e = rpc_error(call, request, metadata=METADATA, timeout=10)
        assert e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
    server.assert_no_leak()


# ----------------------------------------------------------------------------- seeded fuzz

# BUSY: "no free slot" (RESOURCE_EXHAUSTED), a right answer when calls come faster than the
# engine core hands back the slots of the calls refused just before (on a loaded machine)
ALLOWED = {"OK", "INVALID_ARGUMENT", "BUSY"}


def test_fuzzed_request_bytes(server, channel):
    """Raw bytes as serialized requests, through grpc's generic calls: random, and mutations of
    valid requests (seeded). Every call ends OK or INVALID_ARGUMENT (or BUSY), none hangs."""
    rng = random.Random(45)
    unary = channel.unary_unary(SERVICE + "Recognize")
    stream = channel.stream_stream(SERVICE + "StreamingRecognize")
    config_bytes = streaming([])[0].SerializeToString()
    codes = collections.Counter()
    for _ in range(400):
        if rng.random() < 0.4:
            codes[outcome(lambda: unary(raw_request(rng), metadata=METADATA, timeout=10))] += 1
        else:
            requests = [raw_request(rng) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.5:
                requests.insert(0, config_bytes)  # past admission: a slot is held while the garbage arrives
            codes[outcome(lambda: stream(iter(requests), metadata=METADATA, timeout=10))] += 1
    assert set(codes) <= ALLOWED and codes["INVALID_ARGUMENT"] > 300 and codes["BUSY"] < 40, codes
    server.assert_no_leak()


def test_fuzzed_field_values(server, stub):
    """Well-formed requests with seeded random field values and audio: OK or INVALID_ARGUMENT (or
    BUSY), every reason short and escaped."""
    rng = random.Random(4545)
    served = [c.model_name for c in stub.GetRivaSpeechRecognitionConfig(
        rasr.RivaSpeechRecognitionConfigRequest(), metadata=METADATA).model_config]  # fmt: skip
    codes = collections.Counter()
    for _ in range(300):
        cfg, audio = random_config(rng, served), random_audio(rng)
        if rng.random() < 0.3:
            call = lambda: stub.Recognize(rasr.RecognizeRequest(config=cfg, audio=b"".join(audio)),  # noqa: E731
                                          metadata=METADATA, timeout=20)  # fmt: skip
        else:
            requests = [rasr.StreamingRecognizeRequest(streaming_config=rasr.StreamingRecognitionConfig(
                config=cfg, interim_results=rng.random() < 0.5)), *(rasr.StreamingRecognizeRequest(audio_content=a)
                                                                     for a in audio)]  # fmt: skip
            call = lambda: stub.StreamingRecognize(iter(requests), metadata=METADATA, timeout=20)  # noqa: E731
        e = rpc_error(call)
        busy = e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no free slot" in e.details()
        codes["BUSY" if busy else "OK" if e is None else e.code().name] += 1
        if e is not None:
            assert len(e.details()) < 400 and "\x1b" not in e.details() and "\0" not in e.details(), e.details()
    assert set(codes) <= ALLOWED and codes["OK"] > 30 and codes["INVALID_ARGUMENT"] > 150 and codes["BUSY"] < 30, codes
    server.assert_no_leak()


# ----------------------------------------------------------------------------- churn beside a neighbour


def test_churn_beside_a_neighbour_leaks_nothing(server):
    """Calls cancelled, channels closed under them, deadlines expiring, and hand-made HTTP/2
    connections cut mid-preface, after their headers, mid-message and mid-frame with a FIN or an
    RST, all while the server is sending; a paced neighbour keeps every token (finals and word
    times equal to the same file sent alone); every slot comes back and memory stays bounded."""
    wavs = UTTERANCES[:4]
    alone = {wav: neighbour(server, wav, paced=False) for wav in wavs}
    assert all(alone.values())
    rss_before = memory_mb(server)
    done, seen = threading.Event(), []

    def neighbours() -> None:
        """The wavs in turn, until the churn is over and each has played beside it at least once:
        the file playing then is the last (finishing the round after it cost CI up to 9 s)."""
        while not done.is_set() or len(seen) < len(wavs):
            wav = wavs[len(seen) % len(wavs)]
            seen.append((wav, neighbour(server, wav, paced=True)))

    t = threading.Thread(target=neighbours)
    t.start()
    rng = random.Random(4546)
    codes = collections.Counter()
    ops = [("grpc", how) for how in ("cancel", "close", "deadline")] * 4 + [
        ("raw", (cut, rst)) for cut in ("preface", "headers", "message", "frame") for rst in (False, True)] * 2
    rng.shuffle(ops)
    try:
        for kind, how in ops:
            if kind == "grpc":
                codes[how, grpc_churn(server, how)] += 1
            else:
                raw_churn(server, *how)
    finally:
        done.set()
        t.join(60)
    assert codes == {("cancel", grpc.StatusCode.CANCELLED): 4, ("close", grpc.StatusCode.CANCELLED): 4,
                     ("deadline", grpc.StatusCode.DEADLINE_EXCEEDED): 4}, codes  # fmt: skip
    assert len(seen) >= 4 and all(finals == alone[wav] for wav, finals in seen), seen
    server.assert_no_leak()
    growth_mb = memory_mb(server) - rss_before
    assert growth_mb < 40, growth_mb
