"""pipecat's OpenAIRealtimeSTTService, unchanged but for its URL, behind pipecat's own local VAD.

Run by tests/test_framework_clients.py in the interpreter that has pipecat (its pins clash with
this project's lock, so it lives in a venv of its own):

    python pipecat_realtime_stt.py WS_BASE_URL TOKEN TURN.pcm ...   # PCM16 mono at 16 kHz each

The service's default mode as its users run it: a 16 kHz pipeline (SileroVADAnalyzer takes 8 or
16 kHz only) of VADProcessor(SileroVADAnalyzer()) -> OpenAIRealtimeSTTService -> a collector.
Audio goes in as one continuous stream, as a transport delivers it: 20 ms InputAudioRawFrames,
the turns back to back with 1 s of silence after each, at 4x real time (the VAD counts samples,
not seconds, so the pace does not move its decisions). pipecat's VAD decides where each turn
ends (the service sends `input_audio_buffer.commit` on its VADUserStoppedSpeakingFrame) and
pipecat's stream resampler turns the 16 kHz frames into the 24 kHz appends the server gets: the
test takes each item's audio from the wire, not from these files.

Prints one JSON line per TranscriptionFrame: `{"text": frame.text, "item_id": ...}`. The text is
what a pipeline's next processor reads; the item id (from the event pipecat attaches as
`frame.result`) only pairs the frame with its committed item, since pipecat passes items on in
the order they complete. Stops once every VAD stop has its frame, or once the server fell silent.
"""

import asyncio
import json
import sys

from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    InputAudioRawFrame,
    TranscriptionFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.stt import OpenAIRealtimeSTTService

RATE = 16000
FRAME_BYTES = RATE // 50 * 2  # 20 ms, a transport's usual audio frame
SILENCE_S = 1.0
PACE_S = 0.005  # per 20 ms frame: 4x real time
QUIET_S = 5.0  # once all audio is in: no frame for this long ends the run (an empty item has none)


class Collector(FrameProcessor):
    def __init__(self) -> None:
        super().__init__()
        self.finals: asyncio.Queue = asyncio.Queue()
        self.vad_stops = 0

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            await self.finals.put({"text": frame.text, "item_id": (frame.result or {}).get("item_id")})
        elif isinstance(frame, ErrorFrame):
            await self.finals.put({"type": "error", "error": str(frame.error)})
        elif isinstance(frame, VADUserStoppedSpeakingFrame) and direction == FrameDirection.DOWNSTREAM:
            self.vad_stops += 1
        await self.push_frame(frame, direction)


async def main(base_url: str, token: str, turns: list[bytes]) -> None:
    stt = OpenAIRealtimeSTTService(api_key=token, base_url=base_url)
    collector = Collector()
    task = PipelineTask(Pipeline([VADProcessor(vad_analyzer=SileroVADAnalyzer()), stt, collector]),
                        params=PipelineParams(audio_in_sample_rate=RATE, enable_metrics=False))
    audio = b"".join(t + bytes(round(SILENCE_S * RATE) * 2) for t in turns)

    async def feed() -> None:
        await asyncio.sleep(1.0)  # session.created -> session.update -> session.updated
        for i in range(0, len(audio), FRAME_BYTES):
            await task.queue_frame(InputAudioRawFrame(audio=audio[i : i + FRAME_BYTES], sample_rate=RATE,
                                                      num_channels=1))
            await asyncio.sleep(PACE_S)

    async def collect() -> None:
        feeding = asyncio.create_task(feed())
        shown, quiet_s = 0, 0.0
        while not (feeding.done() and shown >= collector.vad_stops) and quiet_s < QUIET_S:
            try:
                result = await asyncio.wait_for(collector.finals.get(), 0.5)
            except asyncio.TimeoutError:
                quiet_s += 0.5 if feeding.done() else 0.0
                continue
            quiet_s = 0.0
            print(json.dumps(result), flush=True)
            shown += 1
            if result.get("type") == "error":
                break
        feeding.cancel()
        await task.queue_frame(EndFrame())

    await asyncio.gather(PipelineRunner(handle_sigint=False).run(task), collect())


if __name__ == "__main__":
    url, token, *paths = sys.argv[1:]
    asyncio.run(main(url, token, [open(p, "rb").read() for p in paths]))
