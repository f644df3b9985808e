"""pipecat's OpenAIRealtimeSTTService, unchanged but for its URL, in a pipecat pipeline.

Run by tests/test_framework_clients.py in the interpreter that has pipecat (its pins clash with
this project's lock, so it lives in a venv of its own):

    python pipecat_realtime_stt.py WS_BASE_URL TOKEN TURN.pcm ...   # PCM16 mono at 24 kHz each

The pipeline runs at 24 kHz (pipecat's resampler to OpenAI's 24 kHz is then a pass-through, so the
server gets exactly these bytes). Each turn is the service's default local-VAD flow: a VAD start
frame, the turn's audio in 20 ms InputAudioRawFrames, a VAD stop frame (on which the service sends
`input_audio_buffer.commit`); the next turn starts once the turn's TranscriptionFrame came. Prints
one JSON line per TranscriptionFrame: `{"text": frame.text}`, what a pipeline's next processor reads
(not the raw event pipecat attaches as `frame.result`: that is the server's own copy).

Not pipecat's own VAD: the VAD frames are injected at each turn's exact end. pipecat's local VAD
(SileroVADAnalyzer, bundled model) takes 8 or 16 kHz only, and this pipeline runs at 24 kHz so the
server gets exactly these bytes; at 16 kHz pipecat's resampler would change them, and the test
would have to take each item's audio from the wire (issue 51 item 2, left open).
"""

import asyncio
import json
import sys

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    InputAudioRawFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.stt import OpenAIRealtimeSTTService

RATE = 24000
FRAME_BYTES = RATE // 50 * 2  # 20 ms, a transport's usual audio frame


class Collector(FrameProcessor):
    def __init__(self) -> None:
        super().__init__()
        self.finals: asyncio.Queue = asyncio.Queue()

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            await self.finals.put({"text": frame.text})
        elif isinstance(frame, ErrorFrame):
            await self.finals.put({"type": "error", "error": str(frame.error)})
        await self.push_frame(frame, direction)


async def main(base_url: str, token: str, turns: list[bytes]) -> None:
    stt = OpenAIRealtimeSTTService(api_key=token, base_url=base_url)
    collector = Collector()
    task = PipelineTask(Pipeline([stt, collector]),
                        params=PipelineParams(audio_in_sample_rate=RATE, enable_metrics=False))

    async def feed() -> None:
        await asyncio.sleep(1.0)  # session.created -> session.update -> session.updated
        for audio in turns:
            await task.queue_frame(VADUserStartedSpeakingFrame())
            for i in range(0, len(audio), FRAME_BYTES):
                await task.queue_frame(InputAudioRawFrame(audio=audio[i : i + FRAME_BYTES], sample_rate=RATE,
                                                          num_channels=1))
                await asyncio.sleep(0.005)  # 4x real time: pacing does not change what a commit holds
            await task.queue_frame(VADUserStoppedSpeakingFrame())
            result = await asyncio.wait_for(collector.finals.get(), 60)
            print(json.dumps(result), flush=True)
            if result.get("type") == "error":
                break
        await task.queue_frame(EndFrame())

    await asyncio.gather(PipelineRunner(handle_sigint=False).run(task), feed())


if __name__ == "__main__":
    url, token, *paths = sys.argv[1:]
    asyncio.run(main(url, token, [open(p, "rb").read() for p in paths]))
