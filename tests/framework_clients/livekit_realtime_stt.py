"""livekit-plugins-openai's realtime STT, unchanged but for its base URL, outside a worker.

Run by tests/test_framework_clients.py (in this project's environment when livekit is
installed, else in the interpreter NEMO_SERVE_FRAMEWORK_PYTHON names):

    python livekit_realtime_stt.py HTTP_BASE_URL TOKEN MODEL [--sessions K] TURN.pcm ...   # PCM16 mono at 24 kHz

MODEL picks livekit's flow: a realtime-only model (`gpt-realtime-whisper`) runs its local Silero
VAD and sends `input_audio_buffer.commit` at each end of speech, leaving turn_detection unset;
any other model (with use_realtime=True) sets server_vad and never commits. Audio goes in as a
room track would deliver it: 10 ms frames, the turns back to back with 1 s of silence after each
(so the VAD sees each turn end), pushed at 4x real time. With --sessions K (default 1) the turns
are cut into K runs of consecutive turns, each a stream of its own (its own connection and VAD),
all at once from one STT, as an agent serving K rooms. Prints one JSON line per final transcript
({"session": k, "text": ...}) and stops once each stream has one per turn or the server fell silent.
"""

import asyncio
import json
import sys

import numpy as np
from livekit import rtc
from livekit.agents import stt as agents_stt
from livekit.agents.utils import http_context
from livekit.plugins import openai

RATE = 24000
FRAME = RATE // 100  # 10 ms
SILENCE_S = 1.0
QUIET_S = 5.0  # once all audio is in: no event for this long ends the run


def split(turns: list, sessions: int) -> list[list]:
    """K runs of consecutive turns, the first ones a turn longer where K does not divide them."""
    size, extra = divmod(len(turns), sessions)
    bounds = [k * size + min(k, extra) for k in range(sessions + 1)]
    return [turns[a:b] for a, b in zip(bounds, bounds[1:])]


async def run_stream(stt, session: int, turns: list[bytes]) -> None:
    stream = stt.stream()
    gap = np.zeros(int(SILENCE_S * RATE), dtype="<i2").tobytes()

    async def feed() -> None:
        audio = b"".join(t + gap for t in turns)
        for i in range(0, len(audio) // 2, FRAME):
            chunk = audio[2 * i : 2 * (i + FRAME)]
            stream.push_frame(rtc.AudioFrame(data=chunk, sample_rate=RATE, num_channels=1,
                                             samples_per_channel=len(chunk) // 2))
            await asyncio.sleep(0.0025)

    feeding = asyncio.create_task(feed())
    finals = 0
    try:
        while finals < len(turns):
            ev = await asyncio.wait_for(stream.__anext__(), 30 if not feeding.done() else QUIET_S)
            if ev.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT:
                finals += 1
                print(json.dumps({"session": session, "text": ev.alternatives[0].text}), flush=True)
    except (asyncio.TimeoutError, StopAsyncIteration):
        pass
    await feeding
    await stream.aclose()


async def main(base_url: str, token: str, model: str, turns: list[bytes], sessions: int) -> None:
    async with http_context.open():
        stt = openai.STT(base_url=base_url, api_key=token, model=model, use_realtime=True)
        await asyncio.gather(*(run_stream(stt, k, run) for k, run in enumerate(split(turns, sessions))))
        await stt.aclose()


if __name__ == "__main__":
    url, token, model, *paths = sys.argv[1:]
    sessions = 1
    if paths[:1] == ["--sessions"]:
        sessions, paths = int(paths[1]), paths[2:]
    asyncio.run(main(url, token, model, [open(p, "rb").read() for p in paths], sessions))
