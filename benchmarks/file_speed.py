"""How fast POST /v1/audio/transcriptions turns files into text, on a server that is already running.

Sends the 24 bundled utterances (or --audio's WAVs) `--rounds` times through the official `openai`
SDK, `--concurrency` requests at a time, and reports the seconds of audio transcribed per second of
wall time (the real-time factor, RTFx), and each request's latency (post to answer) p50 / p95 /
max against its audio's duration. A file is one engine stream whose audio all arrived at once, so
RTFx over one request is how fast one stream's chunks step; over several it is what the batch adds.

  python benchmarks/file_speed.py --url http://127.0.0.1:8000 --concurrency 1,4 --out file_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402

UTTERANCES = Path(__file__).resolve().parent.parent / "nemo_serve" / "assets" / "demo" / "utterances"


def one_level(client, files: list[tuple[Path, bytes, float]], concurrency: int, rounds: int) -> dict:
    jobs = [f for _ in range(rounds) for f in files]

    def post(job) -> tuple[float, float]:
        path, data, duration_s = job
        start = time.perf_counter()
        client.audio.transcriptions.create(file=(path.name, data), model="any")
        return time.perf_counter() - start, duration_s

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(post, jobs))
    wall_s = time.perf_counter() - start
    latencies = sorted(r[0] for r in results)
    audio_s = sum(r[1] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(jobs),
        "audio_s": round(audio_s, 2),
        "wall_s": round(wall_s, 2),
        "rtfx": round(audio_s / wall_s, 1),
        "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 3),
        "latency_max_s": round(latencies[-1], 3),
        "mean_audio_s": round(audio_s / len(jobs), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--token", default=os.environ.get("NEMO_SERVE_AUTH_TOKEN", "none"))
    p.add_argument("--audio", type=Path, default=UTTERANCES, help="a folder of WAV files")
    p.add_argument("--concurrency", default="1,4", help="comma-separated levels")
    p.add_argument("--rounds", type=int, default=2, help="times each file is sent per level")
    p.add_argument("--server-command", default="", help="how the server was started, kept in the report")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import openai

    client = openai.OpenAI(api_key=args.token, base_url=f"{args.url}/v1", max_retries=0, timeout=600)
    files = [(f, f.read_bytes(), soundfile.info(f).duration) for f in sorted(args.audio.glob("*.wav"))]
    client.audio.transcriptions.create(file=(files[0][0].name, files[0][1]), model="any")  # warm-up
    levels = [one_level(client, files, int(c), args.rounds) for c in args.concurrency.split(",")]
    report = {"run": run_record(), "server_command": args.server_command, "url": args.url, "files": len(files), "levels": levels}
    print(json.dumps(levels, indent=1))
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
