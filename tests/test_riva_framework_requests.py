"""pipecat's and livekit's NVIDIA (Riva gRPC) STT plugins against --grpc-port.

livekit-plugins-nvidia 1.8.9 runs itself (installed with --no-deps, env/nodeps.lock.txt).
pipecat-ai 1.14.0 cannot be installed beside this project's lock, so its requests are sent with
riva.client, which it drives too, built as `NvidiaSTTService` / `NvidiaSegmentedSTTService` build
them (read from its source); likewise livekit's, to check its default model name. Only the
server address, TLS off and the token are changed. Audio goes as a transport hands it over: headerless PCM16 at 16 kHz
in 20 ms messages. Finals are compared with /ws's on the same samples and endpointing.
"""

from __future__ import annotations

import grpc
import pytest
import soundfile

from .helpers_riva import UTTERANCES, ws_text

riva = pytest.importorskip("riva.client")


@pytest.fixture(scope="module")
def server(riva_server):
    """The Riva files' shared server (helpers_riva.py; it started its own with --grpc-port and
    --num-slots 2 before): /ws's finals below come from the same server, in its default mode."""
    return riva_server

PIPECAT_FUNCTION_ID = "bb0837de-8c7b-481f-9ec8-ef5663e9c1fa"  # NVIDIA's hosted nemotron-asr-streaming
LIVEKIT_MODEL = "parakeet-1.1b-en-US-asr-streaming-silero-vad-sortformer"  # livekit's default model


def service(server, function_id: str):
    """riva.client.Auth as both plugins make it (function-id metadata for NVIDIA's cloud, the key
    as a bearer token), pointed at this server without TLS."""
    from .helpers_server import TOKEN

    metadata = [["function-id", function_id], ["authorization", f"Bearer {TOKEN}"]]
    return riva.ASRService(riva.Auth(None, False, f"127.0.0.1:{server.grpc_port}", metadata))


def pcm_messages(wav) -> list[bytes]:
    samples, rate = soundfile.read(wav, dtype="int16")
    assert rate == 16000
    return [samples[i : i + 320].tobytes() for i in range(0, len(samples), 320)]


def pipecat_streaming_config():
    """NvidiaSTTService._create_recognition_config at its defaults (model "" always, stop_history 320)."""
    config = riva.StreamingRecognitionConfig(
        config=riva.RecognitionConfig(
            encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US", model="", max_alternatives=1,
            profanity_filter=False, enable_automatic_punctuation=True, verbatim_transcripts=True,
            sample_rate_hertz=16000, audio_channel_count=1, enable_word_time_offsets=False,
        ),
        interim_results=True,
    )  # fmt: skip
    riva.add_endpoint_parameters_to_config(config, -1, -1.0, 320, -1, -1.0, -1.0)
    return config


def livekit_streaming_config(model: str):
    """nvidia.STT's SpeechStream._create_streaming_config (no endpointing config)."""
    return riva.StreamingRecognitionConfig(
        config=riva.RecognitionConfig(
            encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US", model=model, max_alternatives=1,
            enable_automatic_punctuation=True, sample_rate_hertz=16000, audio_channel_count=1,
            enable_word_time_offsets=True,
        ),
        interim_results=True,
    )  # fmt: skip


def finals(asr, wav, config) -> list[str]:
    responses = asr.streaming_response_generator(pcm_messages(wav), config)
    return [r.alternatives[0].transcript for resp in responses for r in resp.results if r.is_final]


def test_pipecat_nvidia_stt_request_matches_ws_with_its_320_ms_stop_history(server):
    asr = service(server, PIPECAT_FUNCTION_ID)
    for wav in UTTERANCES[:8]:
        got = finals(asr, wav, pipecat_streaming_config())
        assert got == ws_text(server, wav, endpointing={"rule2_min_trailing_silence_s": 0.32}), wav.name
    asr.auth.channel.close()


def test_pipecat_nvidia_segmented_stt_offline_request_matches_ws(server):
    """NvidiaSegmentedSTTService: offline_recognize of a VAD segment (a WAV file's bytes), no model."""
    asr = service(server, "ee8dc628-76de-4acc-8595-1836e7e857bd")
    config = riva.RecognitionConfig(language_code="en-US", max_alternatives=1, profanity_filter=False,
                                    enable_automatic_punctuation=True, verbatim_transcripts=True)  # fmt: skip
    for wav in UTTERANCES[8:12]:
        response = asr.offline_recognize(wav.read_bytes(), config)
        assert [r.alternatives[0].transcript for r in response.results] == ws_text(server, wav), wav.name
    asr.auth.channel.close()


def test_livekit_nvidia_stt_needs_a_served_model_name(server):
    """livekit's default model name is NVIDIA's; refused with the names served here. With
    model set to the served name (or ""), the finals are /ws's."""
    asr = service(server, "1598d209-5e27-4d3c-8079-4751568b1081")
    wav = UTTERANCES[12]
    with pytest.raises(grpc.RpcError) as e:
        finals(asr, wav, livekit_streaming_config(LIVEKIT_MODEL))
    model_name = server.readyz()["model"]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and model_name in e.value.details()
    for wav in UTTERANCES[12:18]:
        assert finals(asr, wav, livekit_streaming_config(model_name)) == ws_text(server, wav), wav.name
    assert finals(asr, wav, livekit_streaming_config("")) == ws_text(server, wav)
    asr.auth.channel.close()


def test_livekit_nvidia_stt_unchanged_matches_ws(server):
    """livekit-plugins-nvidia's STT itself (env/nodeps.lock.txt installs it): a SpeechStream fed
    10 ms frames as a room track delivers them, then ended; its finals are /ws's."""
    nvidia = pytest.importorskip("livekit.plugins.nvidia", reason="livekit-plugins-nvidia is not installed")
    import asyncio

    import numpy as np
    from livekit import rtc
    from livekit.agents import stt as agents_stt

    from .helpers_server import TOKEN

    async def transcribe(wav) -> list[str]:
        samples, rate = soundfile.read(wav, dtype="int16")
        stt = nvidia.STT(server=f"127.0.0.1:{server.grpc_port}", use_ssl=False, api_key=TOKEN, model="")
        stream = stt.stream()
        for i in range(0, len(samples), rate // 100):
            chunk = np.ascontiguousarray(samples[i : i + rate // 100])
            stream.push_frame(rtc.AudioFrame(data=chunk.tobytes(), sample_rate=rate, num_channels=1,
                                             samples_per_channel=len(chunk)))  # fmt: skip
        stream.end_input()
        texts = []
        async with asyncio.timeout(60):
            async for ev in stream:
                if ev.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT:
                    texts.append(ev.alternatives[0].text)
        await stream.aclose()
        return texts

    for wav in UTTERANCES[18:24]:
        reference = ws_text(server, wav)
        assert reference, "no text: the comparison would be weak"
        assert asyncio.run(transcribe(wav)) == reference, wav.name
