"""pipecat's DeepgramSTTService, unchanged but for its base URL, against /v1/listen.

Run by tests/test_deepgram.py in the interpreter that has pipecat (its pins clash with this
project's lock, so it lives in a venv of its own: NEMO_SERVE_FRAMEWORK_PYTHON):

    python pipecat_deepgram_stt.py WS_BASE_URL TOKEN TURN.pcm ...   # PCM16 mono at 16 kHz each

A 16 kHz pipeline of DeepgramSTTService(api_key, base_url) -> a collector, in the service's
default settings (nova-3-general, interim results, punctuate). Audio goes in as a transport
delivers it: 20 ms InputAudioRawFrames at 4x real time, each turn followed by 1 s of silence.
Where a VAD would say the user stopped (after each turn's audio, before its silence), the
driver sends the VADUserStoppedSpeakingFrame a VADProcessor would: the service answers it with
a Finalize, and marks the transcript that answers as finalized.

Prints one JSON line per TranscriptionFrame ({"text", "finalized"}), one per error, and last
{"interim": N}, the InterimTranscriptionFrames seen. Stops once the server fell silent.
"""

import asyncio
import json
import sys

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    TranscriptionFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.deepgram.stt import DeepgramSTTService

RATE = 16000
FRAME_BYTES = RATE // 50 * 2  # 20 ms
SILENCE_S = 1.0
PACE_S = 0.005  # per 20 ms frame: 4x real time
QUIET_S = 1.5  # once all audio is in: no transcript for this long ends the run


class Collector(FrameProcessor):
    def __init__(self) -> None:
        super().__init__()
        self.out: asyncio.Queue = asyncio.Queue()
        self.interim = 0

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            await self.out.put({"text": frame.text, "finalized": bool(frame.finalized)})
        elif isinstance(frame, InterimTranscriptionFrame):
            self.interim += 1
        elif isinstance(frame, ErrorFrame):
            await self.out.put({"type": "error", "error": str(frame.error)})
        await self.push_frame(frame, direction)


async def main(base_url: str, token: str, turns: list[bytes]) -> None:
    stt = DeepgramSTTService(api_key=token, base_url=base_url, sample_rate=RATE)
    collector = Collector()
    task = PipelineTask(Pipeline([stt, collector]), params=PipelineParams(audio_in_sample_rate=RATE, enable_metrics=False))

    async def send(audio: bytes) -> None:
        for i in range(0, len(audio), FRAME_BYTES):
            await task.queue_frame(InputAudioRawFrame(audio=audio[i : i + FRAME_BYTES], sample_rate=RATE, num_channels=1))
            await asyncio.sleep(PACE_S)

    async def feed() -> None:
        await asyncio.sleep(1.0)  # the service connects at its StartFrame
        for turn in turns:
            await send(turn)
            await task.queue_frame(VADUserStoppedSpeakingFrame())
            await send(bytes(round(SILENCE_S * RATE) * 2))

    async def collect() -> None:
        feeding = asyncio.create_task(feed())
        quiet_s = 0.0
        while quiet_s < QUIET_S:
            try:
                result = await asyncio.wait_for(collector.out.get(), 0.5)
            except asyncio.TimeoutError:
                quiet_s += 0.5 if feeding.done() else 0.0
                continue
            quiet_s = 0.0
            print(json.dumps(result), flush=True)
        print(json.dumps({"interim": collector.interim}), flush=True)
        await task.queue_frame(EndFrame())

    await asyncio.gather(PipelineRunner(handle_sigint=False).run(task), collect())


if __name__ == "__main__":
    url, token, *paths = sys.argv[1:]
    asyncio.run(main(url, token, [open(p, "rb").read() for p in paths]))
