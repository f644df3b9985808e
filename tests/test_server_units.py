"""The server's pieces without a server: protocol parsing and states, PCM decoding and
resampling, settings precedence, metric labels, the CLI's one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import soxr

from nemo_serve import cli
from nemo_serve.config import Settings, SettingsError
from nemo_serve.server.audio import AudioDecoder, AudioError
from nemo_serve.server.metrics import batch_size_label
from nemo_serve.server.protocol import (
    ConfigMessage,
    EndMessage,
    ForceFinalMessage,
    ProtocolError,
    ProtocolState,
    check_transition,
    parse_client_text,
)


# ----------------------------------------------------------------------------- protocol


def test_end_of_input_spellings():
    assert isinstance(parse_client_text("Done"), EndMessage)  # sherpa-onnx clients
    assert isinstance(parse_client_text('{"type": "end"}'), EndMessage)
    assert isinstance(parse_client_text('{"type": "force_final"}'), ForceFinalMessage)


def test_config_defaults_aliases_and_refusals():
    c = parse_client_text(json.dumps({"type": "config", "encoding": "int16", "sample_rate": 8000, "id": "x"}))
    assert isinstance(c, ConfigMessage) and c.encoding == "pcm_s16le" and c.sample_rate == 8000
    assert ConfigMessage().encoding == "pcm_f32le" and ConfigMessage().interim_results
    for bad, words in (
        ("not json", "neither JSON"),
        ("[1, 2]", "object"),
        ('{"type": "pause"}', "unknown message type"),
        ('{"type": "config", "encoding": "mp3"}', "encoding"),
        ('{"type": "config", "sample_rate": 100}', "sample_rate"),
        ('{"type": "config", "samplerate": 8000}', "samplerate"),
        ('{"type": "config", "endpointing": {"rule1_min_trailing_silence_s": -1}}', "endpointing"),
    ):
        with pytest.raises(ProtocolError, match=words):
            parse_client_text(bad)


def test_state_machine_rejects_illegal_transitions():
    s = check_transition(ProtocolState.CONNECTED, ProtocolState.STREAMING)
    s = check_transition(s, ProtocolState.ENDING)
    s = check_transition(s, ProtocolState.CLOSED)
    for old, new in (
        (ProtocolState.CLOSED, ProtocolState.STREAMING),
        (ProtocolState.ENDING, ProtocolState.STREAMING),
        (ProtocolState.CONNECTED, ProtocolState.ENDING),
    ):
        with pytest.raises(RuntimeError, match="illegal"):
            check_transition(old, new)


# ----------------------------------------------------------------------------- audio


def test_int16_and_float32_decode():
    x = np.array([0, 16384, -32768, 32767], dtype="<i2")
    assert np.allclose(AudioDecoder("pcm_s16le", 16000, 16000).decode(x.tobytes()), [0, 0.5, -1, 32767 / 32768])
    f = np.array([0.25, -0.5], dtype="<f4")
    assert np.array_equal(AudioDecoder("pcm_f32le", 16000, 16000).decode(f.tobytes()), f)


@pytest.mark.parametrize(
    "encoding, data, words",
    [
        ("pcm_s16le", b"\x00\x01\x02", "whole number"),
        ("pcm_f32le", b"\x00" * 6, "whole number"),
        ("pcm_f32le", np.array([0.0, np.nan], "<f4").tobytes(), "NaN or Inf"),
        ("pcm_f32le", np.array([np.inf], "<f4").tobytes(), "NaN or Inf"),
    ],
)
def test_bad_audio_is_refused(encoding, data, words):
    with pytest.raises(AudioError, match=words):
        AudioDecoder(encoding, 16000, 16000).decode(data)


def test_streaming_resampler_ignores_packet_sizes():
    """The server's output for a stream must not depend on how the client cut it up."""
    x = np.random.default_rng(0).normal(0, 0.1, 8000 * 2).astype(np.float32)
    pieces = []
    d = AudioDecoder("pcm_f32le", 8000, 16000)
    i, sizes = 0, [37, 1001, 5, 800]
    while i < len(x):
        n = sizes[len(pieces) % len(sizes)]
        pieces.append(d.decode(x[i : i + n].tobytes()))
        i += n
    pieces.append(d.flush())
    assert np.array_equal(np.concatenate(pieces), soxr.resample(x, 8000, 16000, quality="HQ"))
    assert d.input_seconds == 2.0


# ----------------------------------------------------------------------------- settings, metrics, cli


def test_settings_precedence_flags_env_defaults():
    env = {"NEMO_SERVE_NUM_SLOTS": "7", "NEMO_SERVE_AUTH_TOKEN": "yes", "NEMO_SERVE_ENDPOINT": "off"}
    s = Settings.from_sources({"num_slots": None, "port": 9000}, env)
    assert (s.num_slots, s.port, s.auth_token, s.endpoint) == (7, 9000, "yes", False)
    assert Settings.from_sources({"num_slots": 3}, env).num_slots == 3
    assert Settings.from_sources({}, {}).host == "127.0.0.1"
    with pytest.raises(SettingsError, match="--num-slots"):
        Settings.from_sources({"num_slots": 0}, {})
    with pytest.raises(SettingsError, match="TLS file not found"):
        Settings.from_sources({"ssl_certfile": "/nonexistent.pem"}, {})


def test_kv_cache_flag_and_env():
    from nemo_serve.cli import build_parser

    assert Settings.from_sources(vars(build_parser().parse_args([])), {}).kv_cache is True
    assert Settings.from_sources(vars(build_parser().parse_args(["--no-kv-cache"])), {}).kv_cache is False
    assert Settings.from_sources({}, {"NEMO_SERVE_KV_CACHE": "off"}).kv_cache is False


def test_batch_size_labels():
    assert [batch_size_label(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [
        "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "33-64", "65-128"
    ]


def test_cli_errors_are_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert cli.main(["--port", "99999"]) == 2
    assert cli.main(["--model", "/nonexistent/model.nemo"]) == 2  # the multi-process server's load failure
    # its metrics directory is gone, and so is the variable: metrics in this process keep working
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("nemo-serve: error: ") for line in err)
    assert "--port" in err[0] and "not found" in err[1]


def test_frontends_0_exits_2_naming_what_to_use_instead():
    """The engine always runs in an engine-core process behind front ends: `nemo-serve --frontends
    0` (or NEMO_SERVE_FRONTENDS=0) is one line on stderr that names --frontends 1, and exit 2,
    before any model is loaded."""
    out = subprocess.run([sys.executable, "-m", "nemo_serve.cli", "--frontends", "0", "--port", "0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("nemo-serve: error: --frontends") and "use --frontends 1" in lines[0], lines[0]
    with pytest.raises(SettingsError, match="NEMO_SERVE_FRONTENDS.*use --frontends 1"):
        Settings.from_sources({}, {"NEMO_SERVE_FRONTENDS": "0"})
    with pytest.raises(SettingsError, match="--frontends.*greater than or equal to 1"):
        Settings.from_sources({"frontends": -1}, {})
    assert Settings.from_sources({"frontends": 1}, {}).frontends == 1


# ----------------------------------------------------------------------------- app, in process


class _FakeModel:
    name = "fake"
    vocabulary = ["a", "b"]
    prompt_dictionary = None
    default_language = None

    class geometry:  # noqa: N801 - mimics ChunkGeometry's attributes
        sample_rate = 16000
        chunk_ms = 160.0
        context_right = 1

    geometries = None

    def geometry_for(self, context_right):
        if context_right not in (None, 1):
            raise ValueError(f"context_right {context_right} is not served here; valid values: 1")
        return self.geometry


class _FakeEngine:
    """The Engine's network-side API with no model: enough for the app's own paths."""

    def __init__(self, num_slots: int = 1) -> None:
        self.model_info = _FakeModel()
        self.num_slots = num_slots
        self.streams: list = []
        self.aborted: list = []
        self.finished: list = []
        self.error: BaseException | None = None
        self.started = True

    @property
    def num_open_streams(self) -> int:
        return len(self.streams) - len(self.aborted)

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self.num_open_streams

    queue_delay_s = 0.0  # never behind

    def overload(self, decide: bool = False, now=None):
        from nemo_serve.admission import Verdict

        return Verdict(None, False, None)  # never behind

    def open_stream(self, on_result, *, stream_id=None, language=None, endpoint=None, context_right=None, phrases=None,
                    boost=None):
        from nemo_serve.engine.errors import NoFreeSlotError

        if self.num_free_slots <= 0:
            raise NoFreeSlotError("full")
        stream = type("S", (), {"stream_id": f"s{len(self.streams)}"})()
        stream.on_result = on_result  # results are delivered by the test, as the loop thread would
        self.streams.append(stream)
        return stream

    def open_by_mode(self) -> dict:
        return {1: self.num_open_streams} if self.num_open_streams else {}

    def push(self, stream, samples) -> None:
        pass

    def finish(self, stream) -> None:
        self.finished.append(stream)

    def force_final(self, stream, at_sample=None) -> None:
        pass

    def abort(self, stream, reason: str = "") -> None:
        if stream not in self.aborted:
            self.aborted.append(stream)

    def start(self) -> "_FakeEngine":
        return self

    def stop(self, timeout_s: float = 0.0) -> None:
        pass

    def cores(self, now=None) -> list[dict]:
        return [{"core": 0, "device": "cpu", "pid": 0, "serving": self.error is None, "free_slots": self.num_free_slots,
                 "total_slots": self.num_slots, "open_streams": self.num_open_streams, "queue_delay_s": 0.0}]  # fmt: skip


def _app(engine, **settings):
    from nemo_serve.compose import server_context
    from nemo_serve.server.app import create_app

    return create_app(server_context(engine, Settings.from_sources(settings, {})))


def test_engine_failure_fails_open_streams_and_health():
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    engine = _FakeEngine()
    with TestClient(_app(engine)) as client:
        with client.websocket_connect("/ws") as ws:
            ws.send_text(json.dumps({"type": "config"}))
            assert ws.receive_json()["type"] == "ready"
            engine.error = RuntimeError("CUDA error: an illegal memory access")  # the step loop died
            msg = ws.receive_json()
            assert msg["type"] == "error" and "engine failed" in msg["reason"]
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()
            assert closed.value.code == 1011
        assert engine.aborted == engine.streams  # finally: abort
        assert client.get("/healthz").status_code == 503
        r = client.get("/readyz")
        assert r.status_code == 503 and not r.json()["ready"]
        assert 'nemo_serve_stream_errors_total{reason="engine"} 1.0' in client.get("/metrics").text


def test_client_disconnect_aborts_the_stream():
    from starlette.testclient import TestClient

    engine = _FakeEngine()
    with TestClient(_app(engine)) as client:
        with client.websocket_connect("/ws") as ws:
            ws.send_bytes(np.zeros(160, "<f4").tobytes())  # no config: defaults, slot taken
            assert ws.receive_json()["type"] == "ready"
            ws.close()  # the client goes away (websocket.disconnect)
            # Waited for inside the block: leaving it cancels the app if it is still running
            # (TestClient's cancel scope), which under load raced the session's own cleanup.
            deadline = time.monotonic() + 5
            while engine.aborted != engine.streams and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # the session's `finally:` goes on past the abort; let it end
        assert engine.aborted == engine.streams and len(engine.streams) == 1


def test_drain_refuses_new_streams_until_open_ones_have_their_finals():
    """SIGTERM's drain (ServerContext.drain), held open by a stream still owed its final: the
    stream's input is ended, a new handshake is refused with HTTP 503, Retry-After and a reason,
    /readyz says draining; the final then arrives with `done` reason "draining" and the drain ends."""
    from starlette.testclient import TestClient, WebSocketDenialResponse

    from nemo_serve.engine.results import StreamResult

    engine = _FakeEngine(num_slots=2)
    app = _app(engine)
    ctx = app.state.ctx
    with TestClient(app) as client:
        with client.websocket_connect("/ws") as ws:
            ws.send_text(json.dumps({"type": "config"}))
            assert ws.receive_json()["type"] == "ready"
            drained = client.portal.start_task_soon(ctx.drain)
            deadline = time.monotonic() + 5
            while engine.finished != engine.streams and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.finished == engine.streams and not drained.done()  # input ended, final still owed
            r = client.get("/readyz")
            assert r.status_code == 503 and r.json()["draining"] and not r.json()["ready"]
            with pytest.raises(WebSocketDenialResponse) as denied:
                with client.websocket_connect("/ws"):
                    pass
            assert denied.value.status_code == 503 and denied.value.headers["retry-after"] == "1"
            assert "draining" in denied.value.json()["reason"]
            assert not drained.done()
            stream = engine.streams[0]
            stream.on_result(StreamResult(stream.stream_id, "a", 0, True, [0], [0], [0.0], 0.0, 1.0, time.time(), done=True))
            assert ws.receive_json()["type"] == "final"
            done = ws.receive_json()
            assert done["type"] == "done" and done["reason"] == "draining"
            drained.result(timeout=5)  # the last session closed itself: the drain is over
        assert not ctx.sessions
        assert 'nemo_serve_refusals_total{reason="draining"} 1.0' in client.get("/metrics").text


def test_client_printer_assembles_long_segment_partials_from_offsets():
    """Partials of a segment over 256 tokens carry only the tail from text_offset (docs/protocol.md)."""
    import io

    from nemo_serve.client import Printer

    out = io.StringIO()
    out.isatty = lambda: True
    p = Printer(out)
    p.width = 200
    p({"type": "partial", "text": "turn on the", "text_offset": 0})
    p({"type": "partial", "text": "the kitchen light", "text_offset": 8})
    assert p.segment_text == "turn on the kitchen light"
    assert out.getvalue().endswith("  ... turn on the kitchen light")
    p({"type": "final", "text": "turn on the kitchen light", "start_time": 0.0})
    p({"type": "partial", "text": "and", "text_offset": 0})
    assert p.segment_text == "and"  # a new segment starts from nothing


def test_a_commit_on_a_continuing_stream_falls_on_the_engines_chunk_grid():
    """NIM's commits are due once the model stepped every whole chunk appended before them; the
    engine's ModelInfo says where that is (hand-computed: 1120 ms-style first chunk of 25 frames,
    later chunks of 32, a frame needs 240 samples past its hop's start)."""
    from nemo_serve.engine.geometry import ChunkGeometry, ModelInfo

    g = ChunkGeometry(context_left=56, context_right=3, first_frames=25, chunk_frames=32, pre_cache_frames=9,
                      drop_frames=2, min_first_frames=1, min_later_frames=8, hop_samples=160, sample_rate=16000,
                      subsampling=8)  # fmt: skip
    model = ModelInfo(name="m", geometry=g, vocabulary=[], is_bpe=True, prompt_dictionary=None,
                      default_language=None, feature_margin=240, summary="")  # fmt: skip
    assert model.whole_chunks_s(None, 0) == 0.0
    assert model.whole_chunks_s(3, 4079) == 0.0  # 24 frames: the first chunk is not whole yet
    assert model.whole_chunks_s(3, 4080) == 0.25  # 25 frames
    assert model.whole_chunks_s(3, 9199) == 0.25  # 56 frames: the second chunk lacks one
    assert model.whole_chunks_s(3, 9200) == 0.57  # 57 frames = 25 + 32
    with pytest.raises(ValueError):
        model.whole_chunks_s(0, 9200)  # a mode not served
