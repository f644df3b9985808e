"""NIM's realtime flow end to end: NVIDIA's own client, `riva.client.realtime.RealtimeClientASR`
(nvidia-riva-client), unchanged against the real `nemo-serve` process. It posts to
/v1/realtime/transcription_sessions with the server's token as its mint key, opens
/v1/realtime?intent=transcription with the minted client secret as a subprotocol, sends the session
back as its update, streams a WAV file as it lies on disk (header included, input format "none"),
append + commit per 100 ms, then input_audio_buffer.done; its transcripts' tokens must equal /ws's.
Plus the session endpoint's answers and the client secret's rules, and in process the secret and
the WAV-header decoder.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile

import nemo_serve
from nemo_serve.server.audio import AudioError
from nemo_serve.server.auth import CLIENT_SECRET_TTL_S, mint_client_secret, valid_client_secret
from nemo_serve.server.wav_stream import WavStreamDecoder

from .helpers_server import SHARED_NUM_SLOTS, TOKEN, finals_tokens_and_text, ws_pcm16_finals
from .helpers_server import leak_checked_server  # noqa: F401 - this module's `server` fixture
from .helpers_nim import nvidia_client_runs, riva_args, run_riva_client

UTTERANCES = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))
TRANSCRIPTION = "conversation.item.input_audio_transcription"
SESSIONS = "/v1/realtime/transcription_sessions"
FINAL_LINE = re.compile(r" - INFO - Final Transcript: (.*)$", re.MULTILINE)


async def ws_tokens(server, path: Path, token: str | None = TOKEN) -> list[int]:
    pcm, rate = soundfile.read(path, dtype="int16")
    return finals_tokens_and_text(await ws_pcm16_finals(server, pcm, rate, token=token))[0]


async def ws_finals(server, path: Path) -> list[str]:
    """/ws's final texts for a file sent as NVIDIA's client sends it (100 ms packets)."""
    pcm, rate = soundfile.read(path, dtype="int16")
    return [m["text"] for m in await ws_pcm16_finals(server, pcm, rate)]


def test_nvidia_realtime_client_prints_and_saves_the_whole_utterance_on_every_bundled_file(server, tmp_path):
    """NVIDIA's client unchanged (scripts/asr/realtime_asr_client.py, or its file path step for
    step: tests/nim_client/), 100 ms appends each followed by a commit: what it prints as its
    `Final Transcript` and saves with --output-text is /ws's transcript of the file. Before issue
    45's fix every commit could end an item and the client showed only the last piece."""
    pytest.importorskip("riva.client.realtime")
    expected = {p.name: " ".join(t for t in asyncio.run(ws_finals(server, p)) if t) for p in UTTERANCES}
    runs = asyncio.run(nvidia_client_runs(server, UTTERANCES, tmp_path, concurrency=SHARED_NUM_SLOTS))
    wrong = {}
    for name, (rc, shown, saved) in runs.items():
        finals = FINAL_LINE.findall(shown)
        if rc != 0 or finals != [expected[name]] or saved != (expected[name] or None) or "Error" in shown:
            wrong[name] = (rc, finals, saved, expected[name], shown[-600:] if rc else "")
    assert not wrong, f"{len(wrong)} of {len(runs)} files: {wrong}"
    assert sum(bool(t) for t in expected.values()) >= len(UTTERANCES) - 2, expected  # the model says something


def test_after_trailing_silence_the_client_still_prints_and_saves_the_utterance(tmp_path, demo_pair_server):
    """The trained demo model, two utterances each followed by 3 s of silence: the endpointer
    closes the utterance (the client logs it as an interim), the silence until the end is an
    empty last item, and the client's final must still be the utterance, not empty. Before: it
    printed `Final Transcript: ` and saved nothing."""
    pytest.importorskip("riva.client.realtime")
    files = []
    for k in (0, 5):
        pcm, rate = soundfile.read(UTTERANCES[k], dtype="int16")
        files.append(tmp_path / f"{k:03d}_silence.wav")
        soundfile.write(files[-1], np.concatenate([pcm, np.zeros(3 * rate, "int16")]), rate, subtype="PCM_16")
    srv = demo_pair_server  # the demo model's shared server on two slots (helpers_server.py)
    ws = {f.name: asyncio.run(ws_finals(srv, f)) for f in files}
    runs = asyncio.run(nvidia_client_runs(srv, files, tmp_path, concurrency=2))
    srv.assert_no_leak()
    for name, (rc, shown, saved) in runs.items():
        utterance = [t for t in ws[name] if t][-1]
        assert ws[name][-1] == "" and f"Interim Transcript: {utterance}" in shown, (ws[name], shown[-800:])
        assert rc == 0 and FINAL_LINE.findall(shown) == [utterance] and saved == utterance, (name, shown[-800:], saved)


def test_force_eou_ends_the_item_where_the_client_asked_and_decoding_goes_on(server):
    """NIM's `runtime_config.force_eou` on an append (the client's force_eou_chunks): the item
    ends after the whole chunks before it, the next item continues the same decoding, so the
    items' tokens joined are /ws's. Commits (after every packet) end nothing."""
    pytest.importorskip("riva.client.realtime")
    path, at = UTTERANCES[3], 25  # a 3.9 s file, forced after its 26th packet (2.6 s)
    expected = asyncio.run(ws_tokens(server, path))
    events, client = asyncio.run(run_riva_client(riva_args(server), path, force_eou_at=at))
    completed = [e for e in events if e["type"] == f"{TRANSCRIPTION}.completed"]
    ends = [e["nemo_serve"]["item_start"] + e["nemo_serve"]["audio_processed"] for e in completed]
    forced_s = (at + 1) * 0.1
    # At the whole chunks before it, never later, however far the engine ran on meanwhile (a
    # positional force_final: tests/test_nim_forced_end.py pins the exact frame)
    assert len(ends) == 2 and forced_s - 1.2 < ends[0] <= forced_s < ends[1], ends
    assert [t for e in completed for t in e["nemo_serve"]["token_ids"]] == expected and expected
    assert completed[-1]["is_last_result"] is True and client.final_transcript == completed[-1]["transcript"]


def test_the_client_sees_its_session_acknowledged_with_the_wav_container(server):
    """The update NIM's client sends (the POST's answer with input_audio_format "none") is
    answered by transcription_session.updated, which the client requires to go on."""
    pytest.importorskip("riva.client.realtime")
    _, client = asyncio.run(run_riva_client(riva_args(server), UTTERANCES[0]))
    assert client.is_config_updated  # it read transcription_session.updated; session_config is its session
    assert client.session_config["input_audio_format"] == "none"
    assert client.session_config["input_audio_params"]["sample_rate_hz"] == 16000


def test_wrong_mint_key_fails_the_clients_connect_with_its_own_hint(server):
    pytest.importorskip("riva.client.realtime")
    with pytest.raises(Exception, match="Session authentication failed \\(HTTP 401"):
        asyncio.run(run_riva_client(riva_args(server, mint_api_key="wrong"), UTTERANCES[0]))


def test_session_post_answers_nims_documented_shape(server):
    url = server.http_url + SESSIONS
    r = httpx.post(url, json={}, headers=server.auth_headers, trust_env=False, timeout=10)
    assert r.status_code == 200
    s = r.json()
    assert s["object"] == "realtime.transcription_session" and s["id"].startswith("sess_")
    assert s["input_audio_format"] == "pcm16" and s["input_audio_params"] == {"sample_rate_hz": 16000, "num_channels": 1}
    for section in ("input_audio_transcription", "recognition_config", "speaker_diarization", "word_boosting",
                    "endpointing_config"):  # fmt: skip
        assert isinstance(s[section], dict), section
    assert s["client_secret"]["value"].startswith("ek_")
    assert time.time() < s["client_secret"]["expires_at"] <= time.time() + CLIENT_SECRET_TTL_S + 1
    # NIM's other header for the key; an empty body; refusals
    assert httpx.post(url, headers={"X-API-Key": TOKEN}, trust_env=False, timeout=10).status_code == 200
    denied = httpx.post(url, json={}, trust_env=False, timeout=10)
    assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Bearer")
    for body, reason in ((b"[1, 2", "the body is not valid JSON: Expecting ',' delimiter at character 5"),
                         (b"[1, 2]", "the body must be a JSON object (or empty), not an array")):  # fmt: skip
        bad = httpx.post(url, content=body, headers=server.auth_headers, trust_env=False, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["message"] == reason


def test_client_secret_opens_only_realtime_sockets(server):
    """The secret works as the realtime-token subprotocol (answered with `realtime`, never with
    the secret) and as a bearer token on /v1/realtime; not on /ws; a forged one opens nothing."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    secret = httpx.post(server.http_url + SESSIONS, headers=server.auth_headers, trust_env=False,
                        timeout=10).json()["client_secret"]["value"]  # fmt: skip
    forged = secret[:-4] + ("0000" if not secret.endswith("0000") else "1111")
    realtime = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription"

    async def first_event(url: str, **kw) -> tuple[str | None, dict]:
        async with connect(url, **kw) as ws:
            return ws.subprotocol, json.loads(await ws.recv())

    proto, first = asyncio.run(first_event(realtime, subprotocols=["realtime", f"realtime-token.{secret}"]))
    assert proto == "realtime" and first["type"] in ("session.created", "conversation.created")
    _, first = asyncio.run(first_event(realtime, additional_headers={"Authorization": f"Bearer {secret}"}))
    assert first["type"] in ("session.created", "conversation.created")
    for url, kw in ((realtime, {"subprotocols": ["realtime", f"realtime-token.{forged}"]}),
                    (server.ws_url, {"additional_headers": {"Authorization": f"Bearer {secret}"}})):  # fmt: skip
        with pytest.raises(InvalidStatus) as e:
            asyncio.run(first_event(url, **kw))
        assert e.value.response.status_code == 401


# ----------------------------------------------------------------------------- in process


def test_client_secret_expires_and_is_bound_to_the_token():
    secret, expires_at = mint_client_secret("token-a", now=1000.0)
    assert expires_at == 1000 + CLIENT_SECRET_TTL_S
    assert valid_client_secret(secret, "token-a", now=1000.0 + CLIENT_SECRET_TTL_S)
    assert not valid_client_secret(secret, "token-a", now=1001.0 + CLIENT_SECRET_TTL_S)
    assert not valid_client_secret(secret, "token-b", now=1000.0)
    later = secret.replace(f"ek_{expires_at}_", f"ek_{expires_at + 3600}_")  # a longer life, same MAC
    assert not valid_client_secret(later, "token-a", now=1000.0)
    assert not valid_client_secret("ek_garbage", "token-a", now=1000.0)


@pytest.mark.parametrize("frame_bytes", [2, 46, 3200])
def test_wav_header_is_dropped_whatever_the_framing(frame_bytes):
    data = UTTERANCES[0].read_bytes()
    decoder = WavStreamDecoder(16000, 16000)
    got = np.concatenate([decoder.decode(data[i : i + frame_bytes]) for i in range(0, len(data), frame_bytes)])
    assert np.array_equal(got, soundfile.read(UTTERANCES[0], dtype="float32")[0])


def test_headerless_pcm16_passes_through_and_a_mismatched_header_is_refused():
    pcm = np.arange(-50, 50, dtype="<i2")
    decoder = WavStreamDecoder(16000, 16000)
    got = np.concatenate([decoder.decode(pcm[:3].tobytes()), decoder.decode(pcm[3:].tobytes())])
    assert np.array_equal(got, pcm / np.float32(32768))
    with pytest.raises(AudioError, match="WAV header says 16000 Hz but the session says 24000 Hz"):
        WavStreamDecoder(24000, 16000).decode(UTTERANCES[0].read_bytes()[:3200])


def test_openai_beta_sdk_mints_a_secret_and_streams_with_it_as_its_api_key(server):
    """OpenAI's ephemeral-key flow on the same endpoint: the server side creates the session with
    the real token (`client.beta.realtime.transcription_sessions.create`), the client side
    connects with only the secret and streams; its items' tokens are /ws's."""
    openai = pytest.importorskip("openai")
    minted = openai.OpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1", max_retries=0)
    session = minted.beta.realtime.transcription_sessions.create(input_audio_format="pcm16")
    secret = session.client_secret.value
    assert secret.startswith("ek_") and secret != TOKEN
    path = UTTERANCES[4]
    pcm, rate = soundfile.read(path, dtype="int16")
    browser = openai.OpenAI(api_key=secret, base_url=f"{server.http_url}/v1",
                            websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")  # fmt: skip
    events = []
    with browser.beta.realtime.connect(model="any", extra_query={"intent": "transcription"}) as conn:
        conn.send({"type": "transcription_session.update", "session": {"input_audio_params": {"sample_rate_hz": rate}}})
        for i in range(0, len(pcm), rate // 10):
            conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + rate // 10].tobytes()).decode())
        conn.send({"type": "input_audio_buffer.done"})
        for ev in conn:
            events.append(json.loads(ev.to_json()))
    completed = [e for e in events if e["type"] == f"{TRANSCRIPTION}.completed"]
    assert completed and completed[-1]["is_last_result"] is True
    assert [t for e in completed for t in e["nemo_serve"]["token_ids"]] == asyncio.run(ws_tokens(server, path))


def test_without_a_server_token_the_session_has_no_secret_and_the_client_connects_without_one(tokenless_server):
    """NIM's legacy flow: `client_secret: null`, and NVIDIA's client opens the socket with no
    subprotocol; the stream is the same. (On the tokenless server test_loadgen.py uses too:
    helpers_server.py.)"""
    pytest.importorskip("riva.client.realtime")
    srv = tokenless_server
    answer = httpx.post(srv.http_url + SESSIONS, json={}, trust_env=False, timeout=10)
    assert answer.status_code == 200 and answer.json()["client_secret"] is None
    path = UTTERANCES[7]
    expected = asyncio.run(ws_tokens(srv, path, token=None))
    events, client = asyncio.run(run_riva_client(riva_args(srv, mint_api_key=None), path))
    assert client.websocket.subprotocol is None
    completed = [e for e in events if e["type"] == f"{TRANSCRIPTION}.completed"]
    assert [t for e in completed for t in e["nemo_serve"]["token_ids"]] == expected and expected
    srv.assert_no_leak()


def test_a_wav_header_of_many_small_chunks_is_read_once(server):
    """input_audio_format "none" (wav_stream.py): a header of 8,000 empty RIFF chunks (64 kB,
    under the header cap) appended 4 bytes at a time was re-read from its first chunk on every
    append, a cost in the square of its size that stalled the front end's event loop (44 s for
    the decoder alone at 8 bytes an append). Without the fix this session did not finish within
    its 8 s."""
    from websockets.asyncio.client import connect

    header = UTTERANCES[0].read_bytes()[:36] + b"junk\0\0\0\0" * 8000 + b"data\0\0\0\0"
    pcm = soundfile.read(UTTERANCES[0], dtype="int16")[0].tobytes()
    session = {"input_audio_format": "none", "input_audio_params": {"sample_rate_hz": 16000, "num_channels": 1},
               "input_audio_transcription": {"language": "en-US"}, "turn_detection": None}  # fmt: skip

    def append(data: bytes) -> str:
        return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()})

    async def run() -> list[dict]:
        async with asyncio.timeout(8), connect(f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription",
                                                additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:  # fmt: skip
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "transcription_session.update", "session": session}))
            assert json.loads(await ws.recv())["type"] == "transcription_session.updated"
            for i in range(0, len(header), 4):
                await ws.send(append(header[i : i + 4]))
            await ws.send(append(pcm))
            await ws.send(json.dumps({"type": "input_audio_buffer.done"}))
            return [json.loads(m) async for m in ws]

    raw = asyncio.run(run())
    assert not [e for e in raw if e["type"] == "error"], raw
    assert raw[-1]["type"].endswith(".completed") and raw[-1]["is_last_result"] is True, raw[-1]
