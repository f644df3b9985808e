"""OpenAI's Realtime transcription guide flow against nemo-serve, on the 24 bundled utterances:
does each commit's `completed` hold the whole utterance?

Starts `nemo-serve --context-right all` (demo model) and, per utterance, runs the official
`openai` SDK as the guide does it (GA `client.realtime.connect`, `turn_detection: null`, PCM16 at
24 kHz in 20 ms appends at real time, `input_audio_buffer.commit`), `--concurrency` sessions at a
time; the reference is /ws's tokens for the same 24 kHz audio (sent whole, then end of input).

  .venv/bin/python benchmarks/realtime_commit.py --out benchmarks/results/realtime_commit.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time

import numpy as np
import soxr

from benchmarks.common import local_server, run_record, write_json
from nemo_serve.client import StreamingClient
from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances

RATE = 24000
STEP = RATE // 50  # 20 ms


async def guide_flow(port: int, wire: np.ndarray, mode: int | None) -> dict:
    import openai

    client = openai.AsyncOpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1")
    session = {"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE},
                                                            "turn_detection": None}}}  # fmt: skip
    query = {"intent": "transcription", **({"context_right": str(mode)} if mode is not None else {})}
    async with client.realtime.connect(model="nemotron", extra_query=query) as conn:
        await conn.session.update(session=session)
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(wire), STEP)):
            await asyncio.sleep(max(0.0, t0 + k * STEP / RATE - time.monotonic()))
            await conn.input_audio_buffer.append(audio=base64.b64encode(wire[i : i + STEP].tobytes()).decode())
        await conn.input_audio_buffer.commit()
        committed_at = time.monotonic()
        async with asyncio.timeout(30):
            async for ev in conn:
                if ev.type == "conversation.item.input_audio_transcription.completed":
                    e = json.loads(ev.to_json())
                    return {"text": e["transcript"], "token_ids": (e.get("nemo_serve") or {}).get("token_ids"),
                            "completed_after_commit_s": round(time.monotonic() - committed_at, 3)}  # fmt: skip
    return {"text": None, "token_ids": None}


async def ws_tokens(port: int, wire: np.ndarray, mode: int | None) -> tuple[list[int], str]:
    async with StreamingClient(f"ws://127.0.0.1:{port}/ws", sample_rate=RATE, encoding="pcm_s16le",
                               context_right=mode) as c:  # fmt: skip
        await c.send_audio(wire)
        await c.end()
        finals = [m async for m in c.messages() if m["type"] == "final"]
    return [t for f in finals for t in f["token_ids"]], " ".join(f["text"] for f in finals if f["text"])


async def run_all(port: int, wires: list[np.ndarray], mode: int | None, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, wire: np.ndarray) -> dict:
        async with sem:
            got = await guide_flow(port, wire, mode)
            tokens, text = await ws_tokens(port, wire, mode)
        return {"utterance": i, "ws_text": text, **got, "identical": got["token_ids"] == tokens}

    return await asyncio.gather(*(one(i, w) for i, w in enumerate(wires)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--modes", default="13,0", help="context_right values to run, comma-separated")
    p.add_argument("--out", default="benchmarks/results/realtime_commit.json")
    args = p.parse_args()
    wires = []
    for u in load_utterances(BUNDLED_MANIFEST, 16000):
        a = soxr.resample(u.audio, 16000, RATE, quality="HQ")
        wires.append(np.clip(np.round(a * 32768), -32768, 32767).astype("<i2"))
    results = {}
    flags = ("--context-right", "all", "--num-slots", str(4 * args.concurrency), "--max-queue-delay-s", "30")
    with local_server(*flags) as port:
        for mode in [int(m) for m in args.modes.split(",")]:
            rows = asyncio.run(run_all(port, wires, mode, args.concurrency))
            results[str(mode)] = {"identical": sum(r["identical"] for r in rows), "of": len(rows), "rows": rows}
            print(f"context_right {mode}: {results[str(mode)]['identical']}/{len(rows)} completed items token-identical to /ws")
    write_json(args.out, {"run": run_record(), "modes": results})


if __name__ == "__main__":
    main()
