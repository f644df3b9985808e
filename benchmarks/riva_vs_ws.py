"""Riva gRPC against /ws on one running server: same utterances, same pacing, one stream at a time.

  python benchmarks/riva_vs_ws.py --port 8000 --grpc-port 50051 [--token T] [--json out.json]

For each bundled utterance: streamed at real time in 100 ms packets through riva.client's
streaming_response_generator and through /ws (nemo_serve.client); the time from the last packet
sent to the last final received (the end-of-input tail: the model's last chunk plus the
protocol), and whether the final texts agree. Then Recognize (the whole file at once) against /ws
fed as fast as it takes, wall time per file. A tool for people, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import riva.client as riva
import soundfile

import nemo_serve
from nemo_serve.client import StreamingClient

UTTERANCES = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))
PACKET_S = 0.1


def riva_stream(asr, wav: Path, paced: bool) -> tuple[list[str], float]:
    samples, rate = soundfile.read(wav, dtype="int16")
    step = int(rate * PACKET_S)
    sent = {}

    def packets():
        for i in range(0, len(samples), step):
            yield samples[i : i + step].tobytes()
            if paced:
                time.sleep(PACKET_S)
        sent["t"] = time.monotonic()

    config = riva.StreamingRecognitionConfig(
        config=riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, sample_rate_hertz=rate, language_code="en-US"),
        interim_results=True,
    )
    finals, last = [], 0.0
    for response in asr.streaming_response_generator(packets(), config):
        for r in response.results:
            if r.is_final:
                finals.append(r.alternatives[0].transcript)
                last = time.monotonic()
    return finals, last - sent["t"]


async def ws_stream(url: str, token: str | None, wav: Path, paced: bool) -> tuple[list[str], float]:
    samples, rate = soundfile.read(wav, dtype="int16")
    step = int(rate * PACKET_S)
    async with StreamingClient(url, sample_rate=rate, encoding="pcm_s16le", token=token) as c:
        for i in range(0, len(samples), step):
            await c.send_audio(samples[i : i + step])
            if paced:
                await asyncio.sleep(PACKET_S)
        await c.end()
        t_end = time.monotonic()
        finals, last = [], t_end
        async for m in c.messages():
            if m["type"] == "final" and m["text"]:
                finals.append(m["text"])
                last = time.monotonic()
    return finals, last - t_end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--token")
    p.add_argument("--n", type=int, default=len(UTTERANCES))
    p.add_argument("--json")
    a = p.parse_args()
    metadata = [["authorization", f"Bearer {a.token}"]] if a.token else None
    asr = riva.ASRService(riva.Auth(uri=f"127.0.0.1:{a.grpc_port}", metadata_args=metadata))
    url = f"ws://127.0.0.1:{a.port}/ws"
    rows = []
    for wav in UTTERANCES[: a.n]:
        r_text, r_tail = riva_stream(asr, wav, paced=True)
        w_text, w_tail = asyncio.run(ws_stream(url, a.token, wav, paced=True))
        config = riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US")
        t = time.monotonic()
        offline = [r.alternatives[0].transcript for r in asr.offline_recognize(wav.read_bytes(), config).results]
        r_offline_s = time.monotonic() - t
        t = time.monotonic()
        w_fast, _ = asyncio.run(ws_stream(url, a.token, wav, paced=False))
        w_fast_s = time.monotonic() - t
        rows.append({"file": wav.name, "riva_tail_s": r_tail, "ws_tail_s": w_tail, "recognize_s": r_offline_s,
                     "ws_unpaced_s": w_fast_s, "same_text": r_text == w_text == offline == w_fast})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    summary = {
        "n": len(rows),
        "same_text": sum(r["same_text"] for r in rows),
        **{f"{k}_median": statistics.median(r[k] for r in rows) for k in ("riva_tail_s", "ws_tail_s", "recognize_s", "ws_unpaced_s")},
    }
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
