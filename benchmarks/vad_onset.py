"""How soon /v1/realtime says `input_audio_buffer.speech_started` after speech begins, and what
the speech detector costs per stream.

Starts `nemo-serve` (demo model, default mode 1120 ms), then streams each bundled utterance
(nemo_serve/assets/demo/utterances/) through a realtime session with server VAD, as PCM16 at 24
kHz in 20 ms appends at real time, `--concurrency` sessions at a time. The speech onset of an
utterance is its first 10 ms frame within 20 dB of its loudest (energy, not the detector under
test). Per utterance:
  onset latency   wall time from sending the append that holds the onset sample to receiving
                  speech_started;
  first text      the same, to the first transcription delta (a speech event from decoded text);
  start error     speech_started.audio_start_ms (prefix_padding_ms 0) minus the onset.
Then the detector alone, in process: CPU seconds per window and per second of audio.

  .venv/bin/python benchmarks/vad_onset.py --out benchmarks/results/vad_onset.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time

import numpy as np
import soxr

from benchmarks.common import local_server, percentiles, run_record, write_json
from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances
from nemo_serve.server.speech_detector import SpeechDetector

RATE = 24000
APPEND_S = 0.02
TRANSCRIPTION = "conversation.item.input_audio_transcription"


def onset_s(audio: np.ndarray, rate: int = 16000) -> float:
    frame = rate // 100
    rms = np.sqrt(np.mean(audio[: len(audio) // frame * frame].reshape(-1, frame) ** 2, axis=1))
    return float(np.flatnonzero(rms >= rms.max() * 0.1)[0] * frame / rate)


async def one(port: int, audio16k: np.ndarray) -> dict:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    wire = np.clip(np.round(soxr.resample(audio16k, 16000, RATE, quality="HQ") * 32768), -32768, 32767).astype("<i2")
    onset = onset_s(audio16k)
    step = int(RATE * APPEND_S)
    sent_at: list[float] = []
    got: dict[str, float] = {}
    start_ms = None
    for attempt in range(20):  # a slot still on its way back from the previous session: HTTP 503
        try:
            ws = await connect(f"ws://127.0.0.1:{port}/v1/realtime")
            break
        except InvalidStatus:
            await asyncio.sleep(0.25)
    async with ws:
        await ws.recv()
        vad = {"type": "server_vad", "silence_duration_ms": 500, "prefix_padding_ms": 0, "threshold": 0.5}
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription",
                                  "audio": {"input": {"turn_detection": vad}}}}))  # fmt: skip

        async def reader():
            nonlocal start_ms
            async for m in ws:
                e = json.loads(m)
                t = time.monotonic()
                if e["type"] == "input_audio_buffer.speech_started" and "speech" not in got:
                    got["speech"], start_ms = t, e["audio_start_ms"]
                if e["type"] == f"{TRANSCRIPTION}.delta" and "text" not in got:
                    got["text"] = t
                if e["type"] == f"{TRANSCRIPTION}.completed":
                    return

        task = asyncio.create_task(reader())
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(wire), step)):
            await asyncio.sleep(max(0.0, t0 + k * APPEND_S - time.monotonic()))
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(wire[i : i + step].tobytes()).decode()}))  # fmt: skip
            sent_at.append(time.monotonic())
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await asyncio.wait_for(task, 30)
    onset_append = sent_at[min(len(sent_at) - 1, int(onset * RATE) // step)]
    return {
        "onset_s": round(onset, 3),
        "onset_latency_s": round(got["speech"] - onset_append, 3) if "speech" in got else None,
        "first_text_latency_s": round(got["text"] - onset_append, 3) if "text" in got else None,
        "start_error_s": round(start_ms / 1000 - onset, 3) if start_ms is not None else None,
    }


async def run_all(port: int, utts: list[np.ndarray], concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)

    async def limited(a):
        async with sem:
            return await one(port, a)

    return await asyncio.gather(*(limited(a) for a in utts))


def detector_cost(utts: list[np.ndarray]) -> dict:
    d = SpeechDetector(16000)
    d.push(np.zeros(16000, dtype=np.float32))  # first-call set-up out of the measure
    cpu0, n = time.process_time(), 0
    for a in utts:
        for i in range(0, len(a), 320):
            d.push(a[i : i + 320])
        n += len(a)
    cpu = time.process_time() - cpu0
    return {"cpu_us_per_window": round(cpu / (n / 512) * 1e6, 1), "cpu_s_per_audio_s": round(cpu / (n / 16000), 5)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/vad_onset.json")
    args = p.parse_args()
    utts = [u.audio for u in load_utterances(BUNDLED_MANIFEST, 16000)]
    with local_server("--num-slots", str(2 * args.concurrency), "--max-queue-delay-s", "30") as port:
        rows = asyncio.run(run_all(port, utts, args.concurrency))
    summary = {
        key: percentiles([r[key] for r in rows if r[key] is not None])
        for key in ("onset_latency_s", "first_text_latency_s", "start_error_s")
    }
    result = {"run": run_record(), "utterances": len(rows), "concurrency": args.concurrency,
              "missed": sum(r["onset_latency_s"] is None for r in rows), "summary": summary,
              "max_onset_latency_s": max(r["onset_latency_s"] for r in rows if r["onset_latency_s"] is not None),
              "detector": detector_cost(utts), "rows": rows}  # fmt: skip
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "run")}, indent=1))


if __name__ == "__main__":
    main()
