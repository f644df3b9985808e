"""End to end over /ws, the server's limits: admission at N slots, a dropped connection, auth,
idle timeout and stream duration, health and metrics, overload refusal, and the drain on SIGTERM.

The shared server (`shared_server`, see test_server_e2e.py): 3 slots, 5 s idle timeout, 10 s
streams, a bearer token. Each test ends with `assert_no_leak`. The overload and SIGTERM tests
start servers of their own (a test hook that slows every step; SIGTERM ends the process).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import time

import numpy as np
import pytest

from nemo_serve.client import ServerRefused, StreamingClient
from nemo_serve.oracle import oracle_transcribe

from . import helpers
from .helpers_e2e import check_well_formed, oracle_tokens, stream
from .helpers_server import (
    PROMPT_TEST_MODEL,
    SHARED_NUM_SLOTS as NUM_SLOTS,
    TEST_MODEL,
    TOKEN,
    encode,
    raw_session,
    start_server,
)


@pytest.fixture
def server(shared_server):
    return shared_server


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
    """Idle: a stream that said only its config, and beside it (the same 5 s) a connection that
    never sends its first message, which holds no slot and times out the same way (protocol.md)."""

    async def scenario():
        t0 = time.monotonic()
        idle_task = asyncio.create_task(raw_session(server.ws_url, [json.dumps({"type": "config"})]))
        silent_task = asyncio.create_task(raw_session(server.ws_url, []))
        await asyncio.sleep(1.0)
        held = (await asyncio.to_thread(server.readyz))["open_streams"]
        idle, silent = await idle_task, await silent_task
        idle_s = time.monotonic() - t0
        long = np.zeros(16000 * 12, dtype="<f4")  # 12 s > --max-stream-s 10
        frames = [long[i : i + 16000].tobytes() for i in range(0, len(long), 16000)]
        capped = await raw_session(server.ws_url, [json.dumps({"type": "config"}), *frames])
        return idle, silent, held, idle_s, capped

    (idle_msgs, idle_code), silent, held, idle_s, (capped_msgs, capped_code) = asyncio.run(scenario())
    assert idle_msgs[-1]["type"] == "error" and "idle" in idle_msgs[-1]["reason"] and idle_code == 1008
    assert held == 1, held  # the config's stream; the silent connection holds no slot
    assert [m["type"] for m in silent[0]] == ["error"] and "idle" in silent[0][0]["reason"] and silent[1] == 1008, silent
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
    # 1.6 s of speech: 20 chunks, the limit crossed by the third; each stepped chunk costs 0.2 s
    # here, so the whole 2.7 s utterance cost 7 s of CI for no further check
    utt = helpers.utterances(1, seed=5)[0][:25600]
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
        # Refused for being behind, not only for a cap. The reason prints the delay to 2 decimals
        # (a CI run refused at 0.30x s said "0.30 s (limit 0.3 s)"), so compare within that rounding.
        assert said >= limit_s - 0.005, refused.reason
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
