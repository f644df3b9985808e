"""End to end: the real `nemo-serve` process, spoken to over WebSocket: parity with NeMo's loop,
bad input, per-stream chunk modes, and the command-line client (admission, limits and drain are
in test_server_limits.py).

One server for the session (`shared_server`: starting one costs NeMo's import and the model
build), with small limits so that the limit tests are quick: 3 slots, 5 s idle timeout,
10 s streams, and a bearer token. Each test ends with `assert_no_leak` (every slot free
again).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import soundfile

from nemo_serve.client import stream_microphone
from nemo_serve.oracle import oracle_transcribe

from . import helpers
from .helpers_e2e import check_segment_times, check_well_formed, oracle_tokens, stream
from .helpers_server import TEST_MODEL, TOKEN, as_model_input, encode, raw_session


@pytest.fixture
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def oracle_model():
    return helpers.model(TEST_MODEL, None)


# ----------------------------------------------------------------------------- parity


def test_concurrent_staggered_streams_match_oracle(server, oracle_model):
    """int16 at 8 kHz, float32 at 16 kHz, int16 at 16 kHz; staggered starts, odd packet sizes,
    one stream forced to a final mid-way: every stream's tokens equal NeMo's own loop's."""
    utts = helpers.utterances(3, seed=11)
    cases = [  # encoding, rate, start delay, packet (samples), force_final_at (sample)
        ("pcm_s16le", 8000, 0.0, 1000, None),
        ("pcm_f32le", 16000, 0.3, 1600, 16000),
        ("pcm_s16le", 16000, 0.8, 4001, None),
    ]
    wires = []
    for (encoding, rate, *_), audio in zip(cases, utts):
        x = audio if rate == 16000 else as_model_input(audio, 16000, rate)  # a real 8 kHz signal
        wires.append(encode(x, encoding))

    async def run_all():
        return await asyncio.gather(
            *(
                stream(server.ws_url, w, rate, enc, packet=p, speed=4.0, delay_s=d, force_final_at=ff, stream_id=f"s{i}")
                for i, (w, (enc, rate, d, p, ff)) in enumerate(zip(wires, cases))
            )
        )

    transcripts = asyncio.run(run_all())
    for i, (t, w, (enc, rate, *_)) in enumerate(zip(transcripts, wires, cases)):
        check_well_formed(t)
        assert t.ready["input_sample_rate"] == rate and t.ready["encoding"] == enc
        assert all(m.get("id") == f"s{i}" for m in t.messages)
        assert t.token_ids == oracle_tokens(oracle_model, w, rate), f"stream {i} ({enc} at {rate} Hz)"
    assert len(transcripts[1].finals) >= 2  # the forced final closed a segment
    for t, audio in zip(transcripts, utts):
        check_segment_times(t.finals, len(audio) / 16000)
    server.assert_no_leak()


def test_sherpa_onnx_style_client_on_root_path(server, oracle_model):
    """No config: float32 at the model's rate on `/`, then the text `Done`."""
    audio = helpers.utterances(1, seed=5)[0]
    frames = [audio[i : i + 8000].astype("<f4").tobytes() for i in range(0, len(audio), 8000)]
    messages, code = asyncio.run(raw_session(server.ws_url.removesuffix("/ws") + "/", [*frames, "Done"]))
    assert [m["type"] for m in messages][0] == "ready" and messages[-1]["type"] == "done" and code == 1000
    tokens = [t for m in messages if m["type"] == "final" for t in m["token_ids"]]
    assert tokens == oracle_transcribe(oracle_model, audio).token_ids
    server.assert_no_leak()


# ----------------------------------------------------------------------------- bad input


def _bad_inputs() -> dict[str, list]:
    cfg = lambda **kw: json.dumps({"type": "config", **kw})  # noqa: E731
    nan = np.zeros(1600, dtype="<f4")
    nan[100] = np.nan
    inf = np.zeros(1600, dtype="<f4")
    inf[7] = np.inf
    return {
        "odd byte count": [cfg(encoding="pcm_s16le"), b"\x01\x02\x03"],
        "f32 not multiple of 4": [b"\x00" * 1601 * 4 + b"\x00\x00"],
        "NaN": [cfg(), nan.tobytes()],
        "Inf": [cfg(), inf.tobytes()],
        "text not JSON": ["hello {"],
        "config after audio": [cfg(), np.zeros(800, "<f4").tobytes(), cfg()],
        "unknown field": [cfg(sampel_rate=8000)],
        "bad encoding": [cfg(encoding="mp3")],
        "language on a model without prompts": [cfg(language="xx-XX")],
        "unknown type": [json.dumps({"type": "pause"})],
    }


def test_malformed_input_fails_only_that_stream(server, oracle_model):
    audio = helpers.utterances(1, seed=21)[0]
    wire = encode(audio, "pcm_f32le")

    async def scenario():
        good = asyncio.create_task(stream(server.ws_url, wire, 16000, "pcm_f32le", speed=2.0))
        outcomes = {}
        for name, frames in _bad_inputs().items():
            outcomes[name] = await raw_session(server.ws_url, frames)
            await asyncio.to_thread(server.wait_open_streams, 1)  # each bad stream gives its slot back
        outcomes["50 MB message"] = await raw_session(server.ws_url, [b"\x00" * (50 << 20)], reasons=too_big_reason)
        return await good, outcomes

    too_big_reason: list[str] = []
    before = stream_errors(server)
    good, outcomes = asyncio.run(scenario())
    after = stream_errors(server)
    for name, (messages, code) in outcomes.items():
        if name == "50 MB message":
            assert code == 1009, (name, code)  # the transport refuses it unread: "message too big"
            # protocol.md's close table: the reason names the frame's size and the limit
            assert too_big_reason == [f"frame with {50 << 20} bytes exceeds limit of {1 << 20} bytes"], too_big_reason
            continue
        errors = [m for m in messages if m["type"] == "error"]
        assert len(errors) == 1 and errors[0]["reason"], (name, messages)
        assert messages[-1]["type"] == "error" and code == 1008, (name, messages, code)
    assert "language" in outcomes["language on a model without prompts"][0][-1]["reason"]
    assert "sampel_rate" in outcomes["unknown field"][0][-1]["reason"]
    check_well_formed(good)
    assert good.token_ids == oracle_transcribe(oracle_model, audio).token_ids
    # Counted by this test's streams alone (the counters are the shared server's, cumulative): each
    # bad stream once, under its reason; the good stream not at all.
    delta = {reason: n - before.get(reason, 0) for reason, n in after.items() if n != before.get(reason, 0)}
    assert delta == {"bad_audio": 4, "protocol": 5, "bad_config": 1, "message_too_big": 1}, delta
    server.assert_no_leak()


def test_after_end_of_input_audio_config_or_end_is_an_error_and_force_final_is_ignored(server):
    """docs/protocol.md, end of input: "Audio, a config or a second end after it is an error; a
    `force_final` is ignored." Each frame follows the end in the same write, so it is read before
    the stream's tail is decoded (sent one `send` at a time, a loaded machine had decoded the tail
    and closed with 1000 before the audio after the end came in)."""
    audio = helpers.utterances(1, seed=8)[0][: 16000 * 2]
    cfg, end = json.dumps({"type": "config"}), json.dumps({"type": "end"})
    head = [cfg, audio.astype("<f4").tobytes(), end]
    after = {
        "audio": (audio[:1600].astype("<f4").tobytes(), "audio after end of input"),
        "config": (cfg, "config must be the first message"),
        "second end": (end, "end of input was already received"),
        "bare Done": ("Done", "end of input was already received"),
    }

    async def session(frames: list) -> tuple[list[dict], int | None]:
        out = await raw_session(server.ws_url, frames, burst=True)
        await asyncio.to_thread(server.wait_open_streams, 0)  # its slot is back before the next one
        return out

    async def scenario():
        plain = await session(head)
        forced = await session([*head, json.dumps({"type": "force_final"})])
        return plain, forced, {name: await session([*head, frame]) for name, (frame, _) in after.items()}

    (plain, plain_code), (forced, forced_code), outcomes = asyncio.run(scenario())
    assert plain[-1]["type"] == "done" and plain_code == 1000 and any(m["type"] == "final" for m in plain)
    strip = lambda ms: [{k: v for k, v in m.items() if k not in ("stream_id", "audio_arrival_time", "sent_time")} for m in ms]  # noqa: E731
    assert forced_code == 1000 and strip(forced) == strip(plain), forced  # the force_final changed nothing
    for name, (messages, code) in outcomes.items():
        errors = [m for m in messages if m["type"] == "error"]
        assert code == 1008 and messages[-1]["type"] == "error" and len(errors) == 1, (name, messages, code)
        assert after[name][1] in errors[0]["reason"], (name, errors)
    server.assert_no_leak()


def stream_errors(server) -> dict[str, float]:
    """nemo_serve_stream_errors_total by reason, as the server counts them now."""
    prefix = 'nemo_serve_stream_errors_total{reason="'
    lines = [line for line in server.metrics().splitlines() if line.startswith(prefix)]
    return {line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


# ----------------------------------------------------------------------------- latency modes


def test_each_stream_picks_its_chunk_mode(server):
    """The shared server runs --context-right all: three streams at the same time and a fourth, one per
    trained mode (one in the URL, the others in the config), each echoed in `ready` and token-identical to NeMo's loop
    at its own mode; /readyz and /metrics count them per mode."""
    modes = server.readyz()["modes"]
    assert [m["chunk_ms"] for m in modes] == [80.0 * (m["context_right"] + 1) for m in modes] and len(modes) == 4
    rights = [m["context_right"] for m in modes]
    model = helpers.model(TEST_MODEL, "all")
    utts = helpers.utterances(4, seed=31)
    wires = [encode(a, "pcm_f32le") for a in utts]

    async def run_all():  # three at once (the shared server has 3 slots), then the fourth
        url_mode = server.ws_url + f"?context_right={rights[0]}"  # the URL's mode, no config field
        first = await asyncio.gather(
            stream(url_mode, wires[0], 16000, "pcm_f32le", packet=1280, speed=4.0),
            *(stream(server.ws_url, w, 16000, "pcm_f32le", packet=1280, speed=4.0, context_right=r)
              for w, r in zip(wires[1:3], rights[1:3])),
        )
        await asyncio.to_thread(server.wait_open_streams, 0)
        return [*first, await stream(server.ws_url, wires[3], 16000, "pcm_f32le", speed=4.0, context_right=rights[3])]

    before = {r: server.metric(f'nemo_serve_mode_streams_total{{context_right="{r}"}}') for r in rights}
    transcripts = asyncio.run(run_all())
    for t, a, r in zip(transcripts, utts, rights):
        check_well_formed(t)
        assert t.ready["context_right"] == r and t.ready["chunk_ms"] == 80.0 * (r + 1)
        assert t.token_ids == oracle_transcribe(model, a, context_right=r).token_ids, r
    text = server.metrics()
    for r in rights:
        assert server.metric(f'nemo_serve_mode_streams_total{{context_right="{r}"}}') == before[r] + 1
        assert f'nemo_serve_batch_size_count{{context_right="{r}"}}' in text
        assert f'nemo_serve_final_latency_seconds_count{{context_right="{r}"}}' in text
    server.assert_no_leak()


def test_a_mode_not_served_is_refused_before_audio(server):
    served = [m["context_right"] for m in server.readyz()["modes"]]
    bad = next(r for r in range(1, 30) if r not in served)
    valid = ", ".join(map(str, served))

    async def both():
        config = json.dumps({"type": "config", "context_right": bad})
        return (await raw_session(server.ws_url, [config, b"\x00" * 3200]),
                await raw_session(server.ws_url + f"?context_right={bad}", [b"\x00" * 3200]))

    for messages, code in asyncio.run(both()):
        assert code == 1008 and [m["type"] for m in messages] == ["error"], messages
        assert messages[0]["reason"].endswith(f"context_right {bad} is not served here; valid values: {valid}")
    server.assert_no_leak()



def test_client_cli_prints_finals(server, tmp_path):
    """`nemo-serve-client FILE` at its default pace (real time, the README's row): it takes about the
    audio's duration, and prints one line per non-empty final, `[start s] text`, exactly the finals
    /ws gives for the same samples (two utterances with a pause between: two endpointed finals)."""
    first, second = helpers.utterances(2, seed=8)
    audio = np.concatenate([first, np.zeros(32000, np.float32), second])  # 2 s: rule 2 ends the first segment
    path = tmp_path / "utt.wav"
    soundfile.write(path, audio, 16000, subtype="PCM_16")
    duration_s = len(audio) / 16000
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "nemo_serve.client", str(path), "--url", server.ws_url, "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=120,
    )
    wall_s = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    wire, _ = soundfile.read(path, dtype="int16")  # the file's samples, read independently of the client
    reference = asyncio.run(stream(server.ws_url, wire, 16000, "pcm_s16le"))
    expected = [f"[{f['start_time']:7.2f}s] {f['text']}" for f in reference.finals if f["text"]]
    assert len(expected) >= 2, reference.finals
    check_segment_times(reference.finals, duration_s)  # the times the client prints are where segments start
    assert out.stdout.splitlines() == expected, (out.stdout, expected)
    # Paced: the last packet leaves at the audio's end; the rest is start-up and the tail's decode.
    assert duration_s <= wall_s < duration_s + 10, (wall_s, duration_s)
    server.assert_no_leak()


def test_client_microphone_with_a_fake_sound_device(server, monkeypatch):
    """`--mic` without a sound card: a stand-in `sounddevice` whose input stream plays an
    utterance from a thread, as PortAudio's callback thread would."""
    audio = encode(helpers.utterances(1, seed=9)[0], "pcm_s16le")

    class RawInputStream:
        def __init__(self, samplerate, channels, dtype, blocksize, callback):
            assert (samplerate, channels, dtype) == (16000, 1, "int16")
            self.blocksize, self.callback, self.stop = blocksize, callback, threading.Event()

        def __enter__(self):
            def play():
                for i in range(0, len(audio), self.blocksize):
                    if self.stop.wait(0.01):
                        return
                    self.callback(audio[i : i + self.blocksize].tobytes(), self.blocksize, None, None)

            self.thread = threading.Thread(target=play, daemon=True)
            self.thread.start()
            return self

        def __exit__(self, *exc):
            self.stop.set()
            self.thread.join()

    monkeypatch.setitem(sys.modules, "sounddevice", types.SimpleNamespace(RawInputStream=RawInputStream))
    messages = []
    asyncio.run(stream_microphone(server.ws_url, messages.append, duration_s=3.0, token=TOKEN))
    assert messages[0]["type"] == "ready" and messages[-1]["type"] == "done"
    assert messages[-1]["audio_processed"] > 0.5 and any(m["type"] == "final" for m in messages)
    server.assert_no_leak()
