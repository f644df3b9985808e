"""End to end: the real `nemo-serve` process, spoken to over WebSocket.

One server for the session (`shared_server`: starting one costs NeMo's import and the model
build), with small limits so that the limit tests are quick: 3 slots, 5 s idle timeout,
10 s streams, and a bearer token. Each test ends with `assert_no_leak` (every slot free
again). SIGTERM gets a server of its own, since it ends it.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import soundfile

from nemo_serve.client import ServerRefused, StreamingClient, Transcript, stream_microphone
from nemo_serve.oracle import oracle_transcribe

from . import helpers
from .helpers_server import (
    PROMPT_TEST_MODEL,
    SHARED_NUM_SLOTS as NUM_SLOTS,
    TEST_MODEL,
    TOKEN,
    as_model_input,
    encode,
    raw_session,
    start_server,
)


@pytest.fixture
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def oracle_model():
    return helpers.model(TEST_MODEL, None)


def oracle_tokens(model, wire: np.ndarray, rate: int) -> list[int]:
    return oracle_transcribe(model, as_model_input(wire, rate)).token_ids


async def stream(
    url: str,
    wire: np.ndarray,
    rate: int,
    encoding: str,
    *,
    packet: int = 1600,
    speed: float = 0.0,
    delay_s: float = 0.0,
    force_final_at: int | None = None,
    sent: list[tuple[float, int]] | None = None,
    **options,
) -> Transcript:
    """One client: config, packets of `packet` samples at `speed` x real time (0: no pacing), end.
    `sent`, if given, gets (monotonic time, samples sent so far) after each packet."""
    await asyncio.sleep(delay_s)
    options.setdefault("token", TOKEN)
    async with StreamingClient(url, sample_rate=rate, encoding=encoding, **options) as c:
        out = Transcript(ready=c.ready)

        async def send() -> None:
            t0 = time.monotonic()
            for i in range(0, len(wire), packet):
                if force_final_at is not None and i <= force_final_at < i + packet:
                    await c.force_final()
                await c.send_audio(wire[i : i + packet])
                if sent is not None:
                    sent.append((time.monotonic(), min(i + packet, len(wire))))
                if speed:
                    await asyncio.sleep(max(0.0, t0 + (i + packet) / rate / speed - time.monotonic()))
            await c.end()

        sender = asyncio.create_task(send())
        async for msg in c.messages():
            out.messages.append(msg)
            if msg["type"] == "final":
                out.finals.append(msg)
            elif msg["type"] == "done":
                out.done = msg
            elif msg["type"] == "error":
                out.error = msg
        # The server may end input itself (drain, duration cap) while we are still sending.
        await asyncio.gather(sender, return_exceptions=True)
        out.close_code = c.close_code
    return out


def check_well_formed(t: Transcript) -> None:
    assert t.error is None, t.error
    assert t.done is not None and t.close_code == 1000
    assert t.messages[-1]["type"] == "done"
    segments = [f["segment"] for f in t.finals]
    assert segments == sorted(segments) and len(set(segments)) == len(segments)
    for m in t.messages:
        if m["type"] in ("partial", "final"):
            assert len(m["tokens"]) == len(m["token_ids"]) == len(m["timestamps"])
            assert m["timestamps"] == sorted(m["timestamps"])
            assert all(ts >= m["start_time"] - 1e-6 for ts in m["timestamps"])
            assert m["audio_arrival_time"] <= m["sent_time"] + 1e-3
    processed = [m["audio_processed"] for m in t.messages if m["type"] in ("partial", "final")]
    assert processed == sorted(processed)


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
        outcomes["50 MB message"] = await raw_session(server.ws_url, [b"\x00" * (50 << 20)])
        return await good, outcomes

    before = stream_errors(server)
    good, outcomes = asyncio.run(scenario())
    after = stream_errors(server)
    for name, (messages, code) in outcomes.items():
        if name == "50 MB message":
            assert code == 1009, (name, code)  # the transport refuses it unread: "message too big"
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


# ----------------------------------------------------------------------------- admission


def test_n_plus_k_clients_at_n_slots(server):
    """N held, k refused at the handshake (HTTP 503), and one that passed the handshake but lost
    the race for the last slot refused with an error and close code 1013; nothing leaks."""
    silence = np.zeros(1600, dtype="<i2")
    refusals = 'nemo_serve_refusals_total{reason="no_free_slot"}'
    refusals_before = server.metric(refusals)

    async def scenario():
        from websockets.asyncio.client import connect

        racer = await connect(server.ws_url, additional_headers=server.auth_headers)  # handshake passes, no slot yet
        held = []
        for i in range(NUM_SLOTS):
            c = StreamingClient(server.ws_url, sample_rate=16000, encoding="pcm_s16le", token=TOKEN)
            held.append(await c.__aenter__())
            await c.send_audio(silence)
        readyz = server.get("/readyz")
        refused = []
        for _ in range(2):
            try:
                async with StreamingClient(server.ws_url, token=TOKEN):
                    pass
            except ServerRefused as e:
                refused.append(e)
        await racer.send(json.dumps({"type": "config"}))
        race = json.loads(await racer.recv())
        await racer.wait_closed()
        for c in held:
            await c.end()
        finals = [[m async for m in c.messages()] for c in held]
        for c in held:
            await c.__aexit__(None, None, None)
        return readyz, refused, race, racer.close_code, finals

    readyz, refused, race, race_code, finals = asyncio.run(scenario())
    assert readyz.status_code == 503 and readyz.json()["free_slots"] == 0
    assert len(refused) == 2 and all(e.status == 503 and "slot" in e.reason for e in refused)
    assert race["type"] == "error" and "slot" in race["reason"] and race_code == 1013
    assert all(f[-1]["type"] == "done" for f in finals)
    assert server.metric(refusals) == refusals_before + 3
    server.assert_no_leak()


def test_disconnect_mid_chunk_frees_slot(server):
    async def scenario():
        from websockets.asyncio.client import connect

        ws = await connect(server.ws_url, additional_headers=server.auth_headers)
        await ws.send(json.dumps({"type": "config"}))
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(np.zeros(5000, dtype="<f4").tobytes())  # a fraction of a chunk
        ws.transport.abort()  # no close handshake: the TCP connection just drops

    asyncio.run(scenario())
    server.assert_no_leak()


# ----------------------------------------------------------------------------- limits and security


def test_auth_header_or_query_token(server):
    async def scenario():
        outcomes = []
        for token in (None, "wrong"):
            try:
                async with StreamingClient(server.ws_url, token=token):
                    outcomes.append("accepted")
            except ServerRefused as e:
                outcomes.append(e.status)
        messages, code = await raw_session(server.ws_url + f"?token={TOKEN}", ["Done"], token=None)
        return outcomes, messages, code

    outcomes, messages, code = asyncio.run(scenario())
    assert outcomes == [401, 401]
    assert messages[0]["type"] == "ready" and messages[-1]["type"] == "done" and code == 1000
    server.assert_no_leak()


def test_idle_timeout_and_max_stream_duration(server):
    async def scenario():
        t0 = time.monotonic()
        idle = await raw_session(server.ws_url, [json.dumps({"type": "config"})])
        idle_s = time.monotonic() - t0
        long = np.zeros(16000 * 12, dtype="<f4")  # 12 s > --max-stream-s 10
        frames = [long[i : i + 16000].tobytes() for i in range(0, len(long), 16000)]
        capped = await raw_session(server.ws_url, [json.dumps({"type": "config"}), *frames])
        return idle, idle_s, capped

    (idle_msgs, idle_code), idle_s, (capped_msgs, capped_code) = asyncio.run(scenario())
    assert idle_msgs[-1]["type"] == "error" and "idle" in idle_msgs[-1]["reason"] and idle_code == 1008
    assert 4.5 < idle_s < 30
    assert capped_msgs[-1]["type"] == "done" and capped_msgs[-1]["reason"] == "max_stream_duration"
    assert any(m["type"] == "final" for m in capped_msgs) and capped_code == 1000
    assert 9.0 <= capped_msgs[-1]["audio_processed"] <= 10.5
    server.assert_no_leak()


def test_health_ready_and_metrics(server):
    assert server.get("/healthz").json() == {"status": "ok"}
    r = server.readyz()
    assert r["ready"] and r["total_slots"] == NUM_SLOTS and r["sample_rate"] == 16000 and r["auth"]
    asyncio.run(stream(server.ws_url, encode(helpers.utterances(1, seed=3)[0], "pcm_s16le"), 16000, "pcm_s16le"))
    text = server.metrics()
    for name in (
        "nemo_serve_open_streams 0.0",
        f"nemo_serve_free_slots {NUM_SLOTS}.0",
        f"nemo_serve_slots {NUM_SLOTS}.0",
        "nemo_serve_refusals_total",
        'nemo_serve_step_duration_seconds_bucket{batch_size="1"',
        "nemo_serve_batch_size_bucket",
        "nemo_serve_audio_seconds_total",
        "nemo_serve_partial_latency_seconds_count",
        "nemo_serve_final_latency_seconds_count",
    ):
        assert name in text, name
    assert server.get("/").status_code == 200 and "nemo-serve" in server.get("/").text
    server.assert_no_leak()


def test_overloaded_server_refuses_new_streams_and_keeps_serving():
    """--max-queue-delay-s: while the model is further behind real time than that, new streams get
    HTTP 503 with the reason, /readyz says so, the refusal is counted, and the stream being served
    loses nothing; once nothing has run for a while (2 s window) streams are admitted again.
    Through the engine core and a front end (the delay crosses shared memory). The model is really
    behind: every step sleeps 0.2 s (the test hook NEMO_SERVE_TEST_STEP_SLEEP_S) while a real-time
    stream brings an 80 ms chunk every 80 ms, so the delay grows by about 0.12 s a chunk past the
    0.3 s limit. (Real overload with real work: benchmarks/overload.py.)"""
    limit_s = 0.3
    utt = helpers.utterances(1, seed=5)[0]
    wire = encode(utt, "pcm_s16le")
    args = ("--num-slots", "2", "--frontends", "1", "--max-queue-delay-s", str(limit_s), "--context-right", "0")
    with start_server(*args, env={"NEMO_SERVE_TEST_STEP_SLEEP_S": "0.2"}) as srv:
        idle = srv.readyz()
        assert idle["ready"] and idle["queue_delay_s"] == 0 and idle["overloaded"] is False and idle["chunk_ms"] == 80
        overloaded = 'nemo_serve_refusals_total{reason="overloaded"}'
        assert srv.metric(overloaded) == 0

        async def scenario():
            served = asyncio.create_task(stream(srv.ws_url, wire, 16000, "pcm_s16le", speed=1.0, packet=1280))
            deadline = time.monotonic() + 30
            while srv.readyz()["queue_delay_s"] <= limit_s:  # behind by more than the limit
                assert time.monotonic() < deadline and not served.done(), srv.readyz()
                await asyncio.sleep(0.02)
            ready = srv.get("/readyz")
            gauge = srv.metric("nemo_serve_queue_delay_seconds")
            with pytest.raises(ServerRefused) as refused:
                async with StreamingClient(srv.ws_url, token=TOKEN):
                    pass
            return await served, ready, gauge, refused.value

        served, ready, gauge, refused = asyncio.run(scenario())
        body = ready.json()
        assert ready.status_code == 503 and body["overloaded"] and body["queue_delay_s"] > limit_s, body
        assert limit_s < gauge < 30, gauge  # the delay only grows while the stream plays
        assert refused.status == 503 and f"(limit {limit_s:g} s)" in refused.reason, refused
        said = float(re.search(r"the model is ([0-9.]+) s behind", refused.reason).group(1))
        assert said > limit_s, refused.reason  # refused for being behind, not only for a cap
        assert srv.metric(overloaded) == 1
        check_well_formed(served)
        model = helpers.model(TEST_MODEL, 0)
        assert [t for f in served.finals for t in f["token_ids"]] == oracle_tokens(model, wire, 16000)
        deadline = time.monotonic() + 10  # the window passes with nothing stepped, the cap grows back
        while not srv.readyz()["ready"]:
            assert time.monotonic() < deadline, srv.readyz()
            time.sleep(0.1)
        assert srv.readyz()["queue_delay_s"] == 0

        async def admitted() -> dict:
            async with StreamingClient(srv.ws_url, token=TOKEN) as client:
                return client.ready

        assert asyncio.run(admitted())["type"] == "ready"
        srv.assert_no_leak()


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


# ----------------------------------------------------------------------------- drain


DRAIN_READ_MARGIN_S = 0.5  # audio sent this long before SIGTERM has been read by the server


def test_sigterm_delivers_finals_then_exits():
    """On a multilingual prompt model, over TLS (a server of its own, since SIGTERM ends it):
    an unknown language is refused with the valid codes; two streams in different languages
    are cut short by SIGTERM, get their finals and `done` with reason "draining"; a socket whose
    stream was not open yet when the drain began (no config sent) is refused with an error that
    says so and close code 1013; the process exits 0. (A new handshake during the drain gets HTTP
    503: test_server_units.py holds a drain open for that; here the drain lasts one step.)"""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    utts = helpers.utterances(2, seed=31)
    languages = ["de-DE", "fr-FR"]
    with start_server("--num-slots", "2", "--drain-timeout-s", "60", model=PROMPT_TEST_MODEL, tls=True) as srv:
        tls = srv.ssl_context
        assert srv.ws_url.startswith("wss://") or shutil.which("openssl") is None
        extra = {"ssl": tls} if tls is not None else {}

        async def scenario():
            config = json.dumps({"type": "config", "language": "xx-XX"})
            unknown = await raw_session(srv.ws_url, [config], ssl_context=tls)
            # Accepted while slots are free, then silent: it holds no slot, and the drain finds it waiting.
            waiting = await connect(srv.ws_url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, **extra)
            clients = [
                asyncio.create_task(
                    stream(srv.ws_url, encode(u, "pcm_f32le"), 16000, "pcm_f32le", speed=1.0, packet=800,
                           language=lang, ssl_context=tls, sent=log)
                )  # fmt: skip
                for u, lang, log in zip(utts, languages, sent)
            ]
            while srv.readyz()["open_streams"] < 2:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            signalled_at = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            refusal = []
            try:
                async with asyncio.timeout(30):
                    async for m in waiting:
                        refusal.append(json.loads(m))
            except ConnectionClosed:
                pass
            # What each client had sent half a second before the signal: by then the server had read it.
            before = [max((n for t, n in log if t <= signalled_at - DRAIN_READ_MARGIN_S), default=0) for log in sent]
            return unknown, await asyncio.gather(*clients), (refusal, waiting.close_code), before

        sent: list[list[tuple[float, int]]] = [[], []]
        (unknown_msgs, unknown_code), transcripts, (refusal, refusal_code), sent_before = asyncio.run(scenario())
        assert srv.proc.wait(timeout=60) == 0
    assert unknown_code == 1008 and all(code in unknown_msgs[-1]["reason"] for code in ("xx-XX", "de-DE", "en-US"))
    assert [m["type"] for m in refusal] == ["error"] and "draining" in refusal[0]["reason"], refusal
    assert refusal_code == 1013
    prompt_model = helpers.model(PROMPT_TEST_MODEL, None)
    for t, audio, lang, before in zip(transcripts, utts, languages, sent_before):
        check_well_formed(t)
        assert t.ready["language"] == lang
        assert t.done["reason"] == "draining"
        # Cut short, and the finals are NeMo's loop on the prefix the server had taken in, whole (not a
        # truncated final): the drain decodes every sample that arrived, with the end-of-input tail rule.
        # That prefix holds at least what the client had sent well before the signal (a server that
        # dropped audio it had read would report a shorter prefix, and NeMo's loop on it would agree).
        # `audio_processed` counts 10 ms feature frames, and at the end of input NeMo's frame count
        # (samples // hop + 1) can reach one frame past the last sample: the prefix is the whole
        # packets of 800 it covers, at most one frame (160 samples) short of it.
        processed = round(t.done["audio_processed"] * 16000)
        taken = processed // 800 * 800
        assert processed - taken <= 160, (processed, taken)
        assert before >= 4000 and before <= taken < len(audio), (before, taken, len(audio))
        assert t.token_ids == oracle_transcribe(prompt_model, audio[:taken], language=lang).token_ids
