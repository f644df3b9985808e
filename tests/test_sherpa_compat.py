"""Clients that send no config: sherpa-onnx's decode-file client, and PCM16 clients that name
their encoding in the URL (?encoding=&sample_rate=) or rely on --default-encoding.

Against the real server (helpers_server). The sherpa-onnx client is rebuilt here step by step
from k2-fsa/sherpa-onnx python-api-examples/online-websocket-client-decode-file.py, since the
package itself is not a dependency: float32 samples at 16 kHz in messages of 8000 samples, 0.1 s
apart, no config, then the text "Done"; a reader task keeps the last message until the text
"Done!" and the script prints json.loads of it as the final result.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from . import helpers
from .helpers_server import TOKEN, as_model_input, encode, raw_session, start_server


def _utterance(seed: int) -> np.ndarray:
    return helpers.utterances(1, seed=seed)[0]


async def _sherpa_decode_file_client(url: str, samples: np.ndarray) -> tuple[str | None, list[str]]:
    """(what the sherpa-onnx script prints as the final result's JSON, every frame it read).
    The one departure: the shared server wants a token, sent as a header (the script sends none)."""
    from websockets.asyncio.client import connect

    frames: list[str] = []

    async def receive_results(socket) -> str | None:
        last_message = ""
        async for message in socket:
            frames.append(message)
            if message != "Done!":
                last_message = message
            else:
                return last_message
        return None  # the server closed without "Done!": the script has no result

    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as websocket:
        receive_task = asyncio.create_task(receive_results(websocket))
        for start in range(0, len(samples), 8000):
            await websocket.send(samples[start : start + 8000].tobytes())
            await asyncio.sleep(0.1 / 10)  # the script's --seconds-per-message 0.1, 10x faster
        await websocket.send("Done")
        result = await asyncio.wait_for(receive_task, 60)
    return result, frames


async def _ws_config_client(url: str, frames: list[bytes], config: dict | None) -> list[dict]:
    first = [json.dumps({"type": "config", **config})] if config is not None else []
    messages, code = await raw_session(url, [*first, *frames, json.dumps({"type": "end"})])
    assert code == 1000 and messages[-1]["type"] == "done", messages[-3:]
    return messages


def _finals(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m.get("type") == "final"]


def test_sherpa_onnx_decode_file_client_gets_done_and_prints_the_last_segment(shared_server):
    """It waits for the text "Done!" (before, it never came and the script printed None). Two
    utterances with a 2 s pause, so /ws gives two endpointed finals: the script prints the message
    before "Done!", which is the last segment's final, exactly, and not the first segment's text
    (docs/protocol.md says so: such a client sees only the last segment of a file)."""
    first, second = helpers.utterances(2, seed=5)
    audio = np.concatenate([first, np.zeros(32000, np.float32), second])  # 2 s: rule 2 ends the first segment
    samples = (encode(audio, "pcm_s16le").astype(np.float32) / 32768).astype("<f4")  # read_wave()
    url = shared_server.ws_url.removesuffix("/ws")  # ws://host:port, as the script builds it
    result, frames = asyncio.run(_sherpa_decode_file_client(url, samples))
    assert result is not None, frames[-3:]
    printed = json.loads(result)
    chunks = [samples[i : i + 8000].tobytes() for i in range(0, len(samples), 8000)]
    ws = asyncio.run(_ws_config_client(shared_server.ws_url, chunks, {"encoding": "pcm_f32le", "sample_rate": 16000}))
    finals = [f for f in _finals(ws) if f["text"]]
    assert len(finals) == 2, [f["text"] for f in finals]  # the input holds several segments
    assert printed["type"] == "final" and printed["segment"] == finals[-1]["segment"] > finals[0]["segment"]
    assert printed["text"] == finals[-1]["text"] and printed["token_ids"] == finals[-1]["token_ids"]
    assert finals[0]["text"] not in printed["text"]  # the first segment is not in what the script prints
    assert "Done!" not in [json.dumps(m) for m in ws]  # {"type": "end"} clients never get the bare text
    shared_server.assert_no_leak()


@pytest.mark.parametrize("end", ["Done", "eof"])
def test_bare_end_texts_get_done_then_the_done_message(shared_server, end):
    audio = encode(_utterance(seed=6), "pcm_f32le")
    messages, code = asyncio.run(raw_session(shared_server.ws_url, [audio.tobytes(), end]))
    types = [m["type"] for m in messages]
    assert code == 1000 and types[-2:] == ["Done!", "done"] and types.count("Done!") == 1, types
    assert types[-3] == "final" and messages[-1]["reason"] == "end"
    shared_server.assert_no_leak()


@pytest.mark.parametrize("rate", [16000, 8000])
def test_url_encoding_and_rate_decode_a_configless_pcm16_client(shared_server, rate):
    audio = _utterance(seed=7)
    wire = encode(audio if rate == 16000 else as_model_input(audio, 16000, rate), "pcm_s16le")
    frames = [wire[i : i + 1600].tobytes() for i in range(0, len(wire), 1600)]
    url = shared_server.ws_url + f"?encoding=pcm_s16le&sample_rate={rate}"
    configless = asyncio.run(_ws_config_client(url, frames, None))
    configured = asyncio.run(
        _ws_config_client(shared_server.ws_url, frames, {"encoding": "pcm_s16le", "sample_rate": rate})
    )
    ready = configless[0]
    assert ready["type"] == "ready" and ready["encoding"] == "pcm_s16le" and ready["input_sample_rate"] == rate
    ids = [t for m in _finals(configless) for t in m["token_ids"]]
    assert ids == [t for m in _finals(configured) for t in m["token_ids"]] and ids
    shared_server.assert_no_leak()


def test_url_values_are_defaults_a_config_message_overrides(shared_server):
    """?encoding=pcm_s16le, then a config that names float32 and no rate: float32, rate from the URL."""
    url = shared_server.ws_url + "?encoding=pcm_s16le&sample_rate=8000"
    messages = asyncio.run(_ws_config_client(url, [], {"encoding": "pcm_f32le"}))
    assert messages[0]["encoding"] == "pcm_f32le" and messages[0]["input_sample_rate"] == 8000
    shared_server.assert_no_leak()


@pytest.mark.parametrize(
    "query, words",
    [
        ("encoding=mp3", ["encoding", "pcm_f32le", "pcm_s16le"]),
        ("sample_rate=44.1k", ["sample_rate", "integer"]),
        ("sample_rate=100", ["sample_rate", "8000"]),
    ],
)
def test_bad_url_encoding_or_rate_is_refused_with_the_reason(shared_server, query, words):
    frames = [np.zeros(1600, "<i2").tobytes(), "Done"]
    messages, code = asyncio.run(raw_session(shared_server.ws_url + "?" + query, frames))
    assert code == 1008 and [m["type"] for m in messages] == ["error"], messages
    reason = messages[0]["reason"]
    assert reason.startswith("invalid query parameter") and all(w in reason for w in words), reason
    shared_server.assert_no_leak()


def test_default_encoding_flag_decodes_a_configless_pcm16_client():
    audio = _utterance(seed=8)
    wire = encode(audio, "pcm_s16le")
    frames = [wire[i : i + 1600].tobytes() for i in range(0, len(wire), 1600)]
    with start_server("--num-slots", "2", "--default-encoding", "pcm_s16le") as server:
        configless = asyncio.run(_ws_config_client(server.ws_url, frames, None))
        configured = asyncio.run(_ws_config_client(server.ws_url, frames, {"encoding": "pcm_s16le"}))
        f32_url = server.ws_url + "?encoding=pcm_f32le"
        as_float = asyncio.run(_ws_config_client(f32_url, [audio.astype("<f4").tobytes()], None))
        assert configless[0]["encoding"] == "pcm_s16le" and as_float[0]["encoding"] == "pcm_f32le"
        ids = [t for m in _finals(configless) for t in m["token_ids"]]
        assert ids == [t for m in _finals(configured) for t in m["token_ids"]] and ids
        assert [t for m in _finals(as_float) for t in m["token_ids"]] == ids  # the URL beats the flag
        server.assert_no_leak()


def test_default_encoding_from_the_environment():
    from nemo_serve.config import Settings, SettingsError

    assert Settings.from_sources({}, {}).default_encoding == "pcm_f32le"
    assert Settings.from_sources({}, {"NEMO_SERVE_DEFAULT_ENCODING": "pcm_s16le"}).default_encoding == "pcm_s16le"
    with pytest.raises(SettingsError, match="--default-encoding"):
        Settings.from_sources({}, {"NEMO_SERVE_DEFAULT_ENCODING": "mp3"})
