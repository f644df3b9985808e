"""Hostile input against a real nemo-serve: fuzzed frames, connect/abort cycles, then a drain.

    python -m benchmarks.fuzz_server --messages 20000 --out benchmarks/results/fuzz_server.json

starts its own server (`--model`, default builtin:tiny-hybrid, info-level log), and reports:

  fuzzed messages  frames sent in `--messages` worth of hostile cases (one connection each:
                   random JSON for every field, wrong types, 5,000-digit integers, deep nesting,
                   half-megabyte strings, invalid UTF-8, odd-sized and NaN audio, frames out of
                   order, oversized frames), each case ended with `Done`
  crashes          close 1011 or an HTTP 5xx other than 503, a server that died, a traceback in
                   its log; `abnormal` counts closes without a close frame (1006), `hangs` cases
                   with no close within the timeout; all three must be 0
  slots leaked     slots still held when every client is gone
  RSS              the server's resident memory before and after
  drain            seconds from SIGTERM (with streams open) to exit, and the exit status
  log              lines and bytes the server logged during the run
  long segment     with --long-segment-s N: one stream of N s of speech without endpointing,
                   bytes sent and the largest partial, against the bytes had every partial
                   carried the whole segment (what the server sent before partial offsets)

tests/test_hardening.py runs `fuzz` with a few hundred messages against its own server; this is
the long run whose figures go in docs/performance.md ("Hostile input").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.hostile_frames import RawText, case_size, hostile_case  # noqa: E402
from benchmarks.server_process import free_port  # noqa: E402

OK_CLOSES = {1000, 1007, 1008, 1009, 1013}  # normal, bad UTF-8, protocol error, too big, busy


# ----------------------------------------------------------------------------- running cases


@dataclass
class FuzzStats:
    cases: int = 0
    messages: int = 0
    bytes_sent: int = 0
    closes: Counter = field(default_factory=Counter)  # close code -> cases
    refused: Counter = field(default_factory=Counter)  # HTTP status at the handshake -> cases
    refusal_reasons: Counter = field(default_factory=Counter)  # their reasons (first words)
    hangs: int = 0  # no close within the timeout
    client_errors: Counter = field(default_factory=Counter)  # other exceptions, by type
    max_reply_bytes: int = 0  # largest message the server sent

    @property
    def crashes(self) -> int:
        return self.closes[1011] + sum(n for s, n in self.refused.items() if s >= 500 and s != 503)

    @property
    def abnormal(self) -> int:
        return sum(n for code, n in self.closes.items() if code not in OK_CLOSES and code != 1011)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["closes"] = {str(k): v for k, v in sorted(self.closes.items())}
        d["refused"] = {str(k): v for k, v in sorted(self.refused.items())}
        d["client_errors"] = dict(self.client_errors)
        d["refusal_reasons"] = dict(self.refusal_reasons)
        d.update(crashes=self.crashes, abnormal=self.abnormal)
        return d


async def run_case(url: str, frames: list, token: str | None, stats: FuzzStats, timeout_s: float) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        async with connect(url, additional_headers=headers, max_size=None, compression=None, open_timeout=timeout_s) as ws:
            try:
                for frame in [*frames, "Done"]:
                    if isinstance(frame, str) and not frame.isascii():
                        frame = RawText(frame.encode("utf-8", "surrogatepass"))  # lone surrogates too
                    if isinstance(frame, RawText):
                        await ws.send(frame.data, text=True)
                    else:
                        await ws.send(frame)
                    stats.messages += 1
                    stats.bytes_sent += case_size(frame)
            except ConnectionClosed:
                pass
            try:
                async with asyncio.timeout(timeout_s):
                    async for message in ws:
                        stats.max_reply_bytes = max(stats.max_reply_bytes, len(message))
            except ConnectionClosed:
                pass
            except TimeoutError:
                stats.hangs += 1
                return
            stats.closes[ws.close_code if ws.close_code is not None else 1006] += 1
    except InvalidStatus as e:
        stats.refused[e.response.status_code] += 1
        try:
            stats.refusal_reasons[json.loads(e.response.body)["reason"][:48]] += 1
        except (ValueError, KeyError, TypeError):
            stats.refusal_reasons["(no JSON reason)"] += 1
    except (OSError, TimeoutError) as e:
        stats.client_errors[type(e).__name__] += 1
    finally:
        stats.cases += 1


async def fuzz(
    url: str,
    num_messages: int,
    seed: int = 0,
    token: str | None = None,
    concurrency: int = 2,
    timeout_s: float = 20.0,
    max_message_bytes: int = 1 << 20,
) -> FuzzStats:
    """Hostile cases on `concurrency` connections at a time until `num_messages` frames went out."""
    rng = random.Random(seed)
    stats = FuzzStats()

    async def worker() -> None:
        while stats.messages < num_messages:
            await run_case(url, hostile_case(rng, max_message_bytes), token, stats, timeout_s)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return stats


async def abort_cycles(url: str, n: int, token: str | None) -> tuple[int, int]:
    """Connect, configure, send a fraction of a chunk, drop the TCP connection: `n` times.
    Returns (cycles, handshakes refused busy): a dropped stream's slot comes back between
    steps, so a quick next cycle may find every slot still held and is retried."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    headers = {"Authorization": f"Bearer {token}"} if token else None
    done = busy = 0
    while done < n:
        try:
            ws = await connect(url, additional_headers=headers, compression=None)
            await ws.send(json.dumps({"type": "config"}))
            if done % 2:
                await ws.recv()
            await ws.send(np.zeros(2000, "<f4").tobytes())
            ws.transport.abort()
            done += 1
        except (InvalidStatus, ConnectionClosed) as e:  # 503 at the handshake, or 1013 just after
            refused = getattr(getattr(e, "response", None), "status_code", None) == 503
            if not refused and getattr(getattr(e, "rcvd", None), "code", None) != 1013:
                raise
            busy += 1
            await asyncio.sleep(0.05)
    return done, busy


# ----------------------------------------------------------------------------- the long run


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _drain(ws_url: str, http_url: str, proc: subprocess.Popen, token: str, num_streams: int) -> dict:
    """Open `num_streams` real-time streams, SIGTERM, time the exit; every stream must end well."""
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Bearer {token}"}
    audio = (np.random.default_rng(1).normal(0, 0.1, 16000 * 30)).astype("<f4")
    ends: list = []

    async def one() -> None:
        async with connect(ws_url, additional_headers=headers, compression=None) as ws:
            await ws.send(json.dumps({"type": "config"}))

            async def send() -> None:
                for i in range(0, len(audio), 1600):
                    await ws.send(audio[i : i + 1600].tobytes())
                    await asyncio.sleep(0.1)

            sender = asyncio.create_task(send())
            last = None
            async for m in ws:
                last = json.loads(m)
            sender.cancel()
            ends.append(((last or {}).get("type"), (last or {}).get("reason"), ws.close_code))

    tasks = [asyncio.create_task(one()) for _ in range(num_streams)]
    while _get(http_url + "/readyz")["open_streams"] < num_streams:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(proc.wait, 120)
    drain_s = time.monotonic() - t0
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"drain_s": round(drain_s, 3), "exit_code": code, "streams": num_streams, "stream_ends": [list(e) for e in ends]}


async def long_segment(ws_url: str, token: str, seconds: int) -> dict:
    """One stream of `seconds` of speech at full speed, endpointing off: what went on the wire,
    and what whole-segment partials (rebuilt from the offsets) would have cost."""
    from websockets.asyncio.client import connect

    from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances, synthetic_utterances

    pool = [u.audio for u in load_utterances(BUNDLED_MANIFEST, 16000)] if BUNDLED_MANIFEST.exists() else [
        u.audio for u in synthetic_utterances(20, 16000, 1)]  # fmt: skip
    speech = np.concatenate(pool).astype("<f4")
    audio = np.tile(speech, seconds * 16000 // len(speech) + 1)[: seconds * 16000]
    sent = whole = largest = num_partials = 0
    held: dict = {"token_ids": [], "tokens": [], "timestamps": [], "text": ""}
    async with connect(ws_url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=None,
                       compression=None) as ws:  # fmt: skip
        await ws.send(json.dumps({"type": "config", "endpointing": {"enabled": False}}))

        async def send() -> None:
            for i in range(0, len(audio), 16000):
                await ws.send(audio[i : i + 16000].tobytes())
            await ws.send(json.dumps({"type": "end"}))

        sender = asyncio.create_task(send())
        async for message in ws:
            sent += len(message)
            m = json.loads(message)
            if m["type"] != "partial":
                whole += len(message)
                continue
            num_partials += 1
            largest = max(largest, len(message))
            offsets = {"text": m["text_offset"], "token_ids": m["token_offset"], "tokens": m["token_offset"],
                       "timestamps": m["token_offset"]}  # fmt: skip
            held = {k: held[k][: offsets[k]] + m[k] for k in held}
            rebuilt = {k: v for k, v in {**m, **held}.items() if k not in ("token_offset", "text_offset")}
            whole += len(json.dumps(rebuilt, ensure_ascii=False, separators=(",", ":")))
        await sender
    return {"seconds": seconds, "partials": num_partials, "bytes_sent": sent, "largest_partial_bytes": largest,
            "bytes_with_whole_segment_partials": whole}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-hybrid", help="'demo' for the shipped demo model")
    p.add_argument("--context-right", type=int, help="the model's mode (default: its first)")
    p.add_argument("--long-segment-s", type=int, default=0, help="then stream this much speech without endpointing")
    p.add_argument("--messages", type=int, default=20_000, help="fuzzed frames to send")
    p.add_argument("--abort-cycles", type=int, default=1000, help="connect/abort cycles after the fuzzing")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--num-slots", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-streams", type=int, default=3)
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args(argv)

    port, token = free_port(), "fuzz-token"
    http_url, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/ws"
    log_path = Path(tempfile.mkstemp(prefix="nemo-serve-fuzz-", suffix=".log")[1])
    env = {**os.environ, "NEMO_SERVE_AUTH_TOKEN": token, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nemo_serve.cli", *(["--model", args.model] if args.model != "demo" else []), "--port", str(port),
           "--num-slots", str(args.num_slots), "--idle-timeout-s", "10", "--log-level", "info"]  # fmt: skip
    if args.context_right is not None:
        cmd += ["--context-right", str(args.context_right)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if _get(http_url + "/readyz").get("ready"):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print(log_path.read_text()[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.5)
        log_before = log_path.stat().st_size
        rss_before = rss_mb(proc.pid)
        t0 = time.monotonic()
        stats = asyncio.run(fuzz(ws_url, args.messages, args.seed, token, args.concurrency))
        fuzz_s = time.monotonic() - t0
        aborted, busy = asyncio.run(abort_cycles(ws_url, args.abort_cycles, token))
        time.sleep(2.0)  # releases happen between steps
        ready = _get(http_url + "/readyz")
        health = _get(http_url + "/healthz")
        rss_after = rss_mb(proc.pid)
        log_text = log_path.read_text(errors="replace")[log_before:]
        segment = asyncio.run(long_segment(ws_url, token, args.long_segment_s)) if args.long_segment_s else None
        drain = asyncio.run(_drain(ws_url, http_url, proc, token, args.drain_streams))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    from benchmarks.common import run_record

    report = {
        "run": run_record(),
        "model": args.model,
        "seed": args.seed,
        "fuzz": stats.as_dict(),
        "fuzz_s": round(fuzz_s, 1),
        "abort_cycles": aborted,
        "abort_cycles_refused_busy": busy,
        "slots_leaked": ready["total_slots"] - ready["free_slots"],
        "open_streams_after": ready["open_streams"],
        "healthz": health.get("status"),
        "rss_mb_before": round(rss_before, 1),
        "rss_mb_after": round(rss_after, 1),
        "log_lines": log_text.count("\n"),
        "log_bytes": len(log_text.encode()),
        "log_tracebacks": log_text.count("Traceback"),
        "drain": drain,
        "long_segment": segment,
    }
    print(
        f"fuzzed messages {stats.messages} in {stats.cases} cases ({fuzz_s:.0f} s), crashes {stats.crashes}, "
        f"abnormal closes {stats.abnormal}, hangs {stats.hangs}, closes {dict(sorted(stats.closes.items()))}, "
        f"refused {dict(stats.refused)}; abort cycles {aborted} ({busy} retried on 503); slots leaked {report['slots_leaked']}; "
        f"RSS {rss_before:.0f} -> {rss_after:.0f} MB; log {report['log_lines']} lines, {report['log_bytes']} bytes, "
        f"{report['log_tracebacks']} tracebacks; drain {drain['drain_s']} s with {drain['streams']} streams, exit {drain['exit_code']}"
    )
    if segment:
        print(
            f"long segment: {segment['seconds']} s without endpointing, {segment['partials']} partials, "
            f"{segment['bytes_sent'] / 1e6:.2f} MB sent, largest partial {segment['largest_partial_bytes']} B; "
            f"whole-segment partials would be {segment['bytes_with_whole_segment_partials'] / 1e6:.1f} MB"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    bad = stats.crashes or stats.abnormal or stats.hangs or report["slots_leaked"] or report["log_tracebacks"]
    return 1 if bad or drain["exit_code"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
