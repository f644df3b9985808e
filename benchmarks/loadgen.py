"""Load generator: N concurrent WebSocket streams at real-time pace against a running nemo-serve.

    python benchmarks/loadgen.py --url ws://127.0.0.1:8000/ws --streams 4,8,16 --duration 60 \
        --audio synth --oracle-model builtin:fastconformer-l --context-right 13 --out load.json

Each of the N workers starts at a staggered time (spread over --ramp-s), walks the test set
from its own starting item (worker w starts at item w*K/N), and streams one item per WebSocket:
config, then packets of exactly the server's chunk (from the `ready` message) sent when that
much audio has "been recorded" (packet k at t0 + (k+1) * chunk), then `end`; it keeps opening
the next item until --duration has passed, then waits for the streams in flight.

Every packet's send time and every message's receive time are recorded. Per level:
  partial latency  receive time of a partial minus send time of the packet holding the last
                   sample the result was computed from (audio_processed + one 10 ms hop: the
                   engine's feature look-ahead), so it includes the client's and the server's
                   event loops, queueing for a batch and the step itself;
  final latency    receive time of the last final minus the time `end` was sent;
  drift            per stream, the least-squares slope of partial latency (ms) against audio
                   position (s); the level reports the median over streams. A server that keeps
                   up has a slope near 0; one that falls behind by a fraction f has ~1000 f ms/s;
  quality          token identity with NeMo's own loop (--oracle-model) and, where the test set
                   has text, WER of the final text;
  errors           refusals, error messages, abnormal closes and timeouts, by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import resource
import sys
import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    CACHE_DIR, SAMPLE_RATE, file_digest, percentiles, read_manifest, run_record, write_json,
)

HOP_SAMPLES = 160  # the engine's feature look-ahead beyond audio_processed (frontend margin - 1 hop)
DRIFT_MIN_PARTIALS = 4
DRIFT_MIN_SPAN_S = 3.0


# ----------------------------------------------------------------------------- test set


@dataclass
class TestItem:
    item_id: str
    audio: np.ndarray  # float32 16 kHz
    text: str | None = None  # reference transcript, if the test set has one
    oracle: list[int] | None = None  # NeMo's loop tokens on the served model


def test_set(source: str, num_items: int = 16, seconds: tuple[float, float] = (10.0, 20.0)) -> list[TestItem]:
    """synth: generated speech-like clips of 10-20 s (for random-weight models); a manifest:
    its utterances concatenated (0.3 s pauses) into items of about seconds[1], each item
    starting at a different utterance, with the joined texts as reference."""
    rng = random.Random(1234)
    if source == "synth":
        from nemo_serve.builtin import synth_audio

        return [
            TestItem(f"synth{i:02d}", synth_audio(rng.uniform(*seconds), seed=9000 + i).numpy())
            for i in range(num_items)
        ]
    utts = read_manifest(source)
    pause = np.zeros(int(0.3 * SAMPLE_RATE), dtype=np.float32)
    items = []
    for i in range(min(num_items, len(utts))):
        k, parts, texts, n = i * len(utts) // num_items, [], [], 0
        while n < seconds[1] * SAMPLE_RATE and len(texts) < len(utts):
            u = utts[k % len(utts)]
            parts += [u.audio, pause]
            texts.append(u.text)
            n += len(u.audio) + len(pause)
            k += 1
        items.append(TestItem(f"utt{i:02d}", np.concatenate(parts[:-1]), " ".join(texts)))
    return items


def oracle_cache_path(path: Path, items: list[TestItem], context_right: int | None, dtype: str, device: str) -> Path:
    """Keyed on the weights' content, not the file's name or size: a retrained demo.nemo has the same size,
    and a stale oracle would count every served stream as a mismatch."""
    h = hashlib.sha256(f"{file_digest(path)}:{context_right}:{dtype}:{device}".encode())
    for it in items:
        h.update(it.audio.tobytes())
    return CACHE_DIR / f"oracle-{h.hexdigest()[:16]}.json"


def attach_oracle(
    items: list[TestItem], model_spec: str, context_right: int | None, dtype: str = "fp32", device: str = "cpu"
) -> None:
    """NeMo's own loop on every item, cached on disk (minutes for FastConformer-L at 160 ms)."""
    import torch

    from benchmarks.common import model_file

    path, _ = model_file(model_spec)
    cache = oracle_cache_path(path, items, context_right, dtype, device)
    if cache.exists():
        tokens = json.loads(cache.read_text())
    else:
        from nemo_serve.model import load_model
        from nemo_serve.oracle import oracle_transcribe

        torch.set_num_threads(1)
        model = load_model(str(path), context_right=context_right, dtype=dtype, device=device)
        tokens = {}
        for it in items:
            tokens[it.item_id] = oracle_transcribe(model, it.audio).token_ids
            print(f"oracle {it.item_id}: {len(tokens[it.item_id])} tokens", file=sys.stderr, flush=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(tokens))
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    for it in items:
        it.oracle = tokens[it.item_id]


# ----------------------------------------------------------------------------- one stream


@dataclass
class StreamRecord:
    worker: int
    item_id: str
    audio_s: float
    opened: float = 0.0  # client time.time()
    chunk_ms: float | None = None
    send_ends: list[int] = field(default_factory=list)  # cumulative samples after each packet
    send_times: list[float] = field(default_factory=list)
    end_sent: float | None = None
    partials: list[tuple[float, float, float, float]] = field(default_factory=list)  # (recv, processed_s, arrival, sent)
    finals: list[dict] = field(default_factory=list)
    final_recv: float | None = None
    done: bool = False
    error: str | None = None

    def packet_send_time(self, processed_s: float) -> float | None:
        need = int(round(processed_s * SAMPLE_RATE)) + HOP_SAMPLES
        i = bisect_left(self.send_ends, need)
        return self.send_times[i] if i < len(self.send_times) else None

    def partial_latencies(self) -> list[tuple[float, float]]:
        """(audio position s, latency s) of every partial whose packet is known."""
        out = []
        for recv, processed, _, _ in self.partials:
            t = self.packet_send_time(processed)
            if t is not None:
                out.append((processed, recv - t))
        return out

    @property
    def final_latency(self) -> float | None:
        if self.final_recv is None or self.end_sent is None:
            return None
        return self.final_recv - self.end_sent

    @property
    def token_ids(self) -> list[int]:
        return [t for f in self.finals for t in f["token_ids"]]

    @property
    def text(self) -> str:
        return " ".join(f["text"] for f in self.finals if f["text"])


async def stream_item(url: str, worker: int, item: TestItem, endpointing: bool, timeout_s: float) -> StreamRecord:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    rec = StreamRecord(worker, item.item_id, len(item.audio) / SAMPLE_RATE, opened=time.time())
    config = {"type": "config", "id": f"w{worker}-{item.item_id}", "encoding": "pcm_f32le", "sample_rate": SAMPLE_RATE}
    if not endpointing:
        config["endpointing"] = {"enabled": False}
    try:
        async with asyncio.timeout(timeout_s):
            async with connect(url, max_size=None, compression=None, open_timeout=30) as ws:
                await ws.send(json.dumps(config))
                ready = json.loads(await ws.recv())
                if ready.get("type") != "ready":
                    rec.error = f"refused: {ready.get('reason', ready.get('type'))}"
                    return rec
                rec.chunk_ms = float(ready["chunk_ms"])
                reader = asyncio.create_task(_read(ws, rec))
                await _send_paced(ws, item.audio, rec)
                await reader
    except InvalidStatus as e:
        rec.error = f"refused: HTTP {e.response.status_code}"
    except ConnectionClosed as e:
        rec.error = rec.error or f"closed {e.rcvd.code if e.rcvd else 'abnormally'}"
    except TimeoutError:
        rec.error = "timeout"
    except OSError as e:
        rec.error = f"connect: {type(e).__name__}"
    if rec.error is None and not rec.done:
        rec.error = "no done message"
    return rec


async def _send_paced(ws, audio: np.ndarray, rec: StreamRecord) -> None:
    """Packet k (one server chunk) goes out when its audio would have been recorded."""
    chunk = int(round(rec.chunk_ms * SAMPLE_RATE / 1000))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for k, start in enumerate(range(0, len(audio), chunk)):
        packet = audio[start : start + chunk]
        delay = t0 + (start + len(packet)) / SAMPLE_RATE - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await ws.send(packet.astype(np.float32).tobytes())
        rec.send_ends.append(start + len(packet))
        rec.send_times.append(time.time())
    await ws.send(json.dumps({"type": "end"}))
    rec.end_sent = time.time()


async def _read(ws, rec: StreamRecord) -> None:
    async for raw in ws:
        now = time.time()
        msg = json.loads(raw)
        kind = msg.get("type")
        if kind == "partial":
            rec.partials.append((now, msg["audio_processed"], msg["audio_arrival_time"], msg["sent_time"]))
        elif kind == "final":
            rec.finals.append({"token_ids": msg["token_ids"], "text": msg["text"], "recv": now})
            rec.final_recv = now
        elif kind == "done":
            rec.done = True
        elif kind == "error":
            rec.error = f"error: {msg.get('reason', '')[:80]}"


# ----------------------------------------------------------------------------- one level


async def run_level(
    url: str,
    items: list[TestItem],
    num_streams: int,
    duration_s: float,
    ramp_s: float = 2.0,
    endpointing: bool = False,
    progress: bool = True,
    workers: list[int] | None = None,
) -> list[StreamRecord]:
    """N workers for duration_s (plus the streams still in flight at the end). `workers`: the
    subset of worker numbers this process runs (see run_level_procs)."""
    loop = asyncio.get_running_loop()
    t_end = loop.time() + duration_s
    records: list[StreamRecord] = []
    bar = _bar(duration_s, f"N={num_streams}") if progress else None

    async def worker(w: int) -> None:
        await asyncio.sleep(ramp_s * w / num_streams + random.uniform(0, 0.08))
        k = w * len(items) // num_streams
        while loop.time() < t_end:
            item = items[k % len(items)]
            timeout = 3 * len(item.audio) / SAMPLE_RATE + 60
            records.append(await stream_item(url, w, item, endpointing, timeout))
            k += 1
            if records[-1].error and records[-1].error.startswith(("refused", "connect")):
                await asyncio.sleep(1.0)  # do not spin on a refusing server

    tasks = [asyncio.create_task(worker(w)) for w in (workers if workers is not None else range(num_streams))]
    start = loop.time()
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1.0)
        if bar is not None:
            bar.n = min(duration_s, loop.time() - start)
            recent = [lat for r in records[-num_streams:] for _, lat in r.partial_latencies()[-3:]]
            bar.set_postfix_str(
                f"streams done {len(records)}, errors {sum(r.error is not None for r in records)}"
                + (f", partial p50 {1000 * float(np.median(recent)):.0f} ms" if recent else "")
            )
            bar.refresh()
    for t in tasks:
        t.result()
    if bar is not None:
        bar.close()
    return records


def run_level_procs(url: str, items: list[TestItem], num_streams: int, duration_s: float, ramp_s: float,
                    endpointing: bool, procs: int) -> list[StreamRecord]:
    """The same level spread over `procs` client processes (worker w runs in process w mod procs),
    so that one Python event loop is not what limits a large N."""
    if procs <= 1:
        return asyncio.run(run_level(url, items, num_streams, duration_s, ramp_s, endpointing))
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # the children inherit the test set instead of pickling it
    global _SHARED_ITEMS
    _SHARED_ITEMS = items
    args = [(url, num_streams, duration_s, ramp_s, endpointing, list(range(p, num_streams, procs))) for p in range(procs)]
    with ctx.Pool(procs) as pool:
        parts = pool.map(_level_part, args)
    return [r for part in parts for r in part]


_SHARED_ITEMS: list[TestItem] = []


def _level_part(a) -> list[StreamRecord]:
    url, n, duration_s, ramp_s, endpointing, workers = a
    return asyncio.run(run_level(url, _SHARED_ITEMS, n, duration_s, ramp_s, endpointing, progress=False, workers=workers))


def _bar(total: float, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="s", file=sys.stderr, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s{postfix}")


# ----------------------------------------------------------------------------- summaries


def drift_slope_ms_per_s(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of latency (ms) against audio position (s); None if too short to tell."""
    if len(points) < DRIFT_MIN_PARTIALS:
        return None
    x = np.array([p for p, _ in points])
    if x.max() - x.min() < DRIFT_MIN_SPAN_S:
        return None
    y = 1000.0 * np.array([lat for _, lat in points])
    return float(np.polyfit(x, y, 1)[0])


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w' ]+", " ", text.lower()).split()


def summarise_level(records: list[StreamRecord], items: list[TestItem], num_streams: int, duration_s: float) -> dict:
    from benchmarks.step_bench import edit_distance

    by_id = {it.item_id: it for it in items}
    ok = [r for r in records if r.error is None]
    partial = [lat for r in ok for _, lat in r.partial_latencies()]
    final = [r.final_latency for r in ok if r.final_latency is not None]
    server = [sent - arrival for r in ok for _, _, arrival, sent in r.partials]
    slopes = [s for s in (drift_slope_ms_per_s(r.partial_latencies()) for r in ok) if s is not None]
    errors = Counter(r.error.split(":")[0] if r.error.startswith(("refused", "connect", "error")) else r.error for r in records if r.error)
    out = {
        "streams": num_streams,
        "duration_s": duration_s,
        "items_started": len(records),
        "items_completed": len(ok),
        "errors": dict(errors),
        "error_examples": sorted({r.error for r in records if r.error})[:5],
        "audio_s_completed": round(sum(r.audio_s for r in ok), 1),
        "partial_latency_ms": _ms(percentiles(partial)),
        "final_latency_ms": _ms(percentiles(final)),
        "server_partial_latency_ms": _ms(percentiles(server)),
        "drift_ms_per_s": {
            "median": float(np.median(slopes)) if slopes else None,
            "p90": float(np.percentile(slopes, 90)) if slopes else None,
            "streams_measured": len(slopes),
        },
        "num_partials": len(partial),
        "quality": _quality(ok, by_id, edit_distance),
    }
    return out


def _ms(p: dict) -> dict:
    return {k: (round(1000 * v, 1) if v is not None else None) for k, v in p.items()}


def _quality(ok: list[StreamRecord], by_id: dict, edit_distance) -> dict:
    q: dict = {}
    with_oracle = [r for r in ok if by_id[r.item_id].oracle is not None]
    if with_oracle:
        ref = sum(len(by_id[r.item_id].oracle) for r in with_oracle)
        err = sum(edit_distance(r.token_ids, by_id[r.item_id].oracle) for r in with_oracle)
        q["token_identical_streams"] = sum(r.token_ids == by_id[r.item_id].oracle for r in with_oracle)
        q["streams_compared"] = len(with_oracle)
        q["token_error_rate_vs_oracle"] = err / max(ref, 1)
    with_text = [r for r in ok if by_id[r.item_id].text]
    if with_text:
        ref_words = sum(len(_words(by_id[r.item_id].text)) for r in with_text)
        err = sum(edit_distance(_words(r.text), _words(by_id[r.item_id].text)) for r in with_text)
        q["wer"] = err / max(ref_words, 1)
    return q


def keeps_up(level: dict, max_drift_ms_per_s: float = 20.0) -> bool:
    """The DESIGN's criterion: partial latency stops growing (median drift near zero), every
    stream completed, and no stream was refused."""
    d = level["drift_ms_per_s"]["median"]
    return d is not None and d <= max_drift_ms_per_s and not level["errors"] and level["items_completed"] > 0


def cpu_seconds_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- CLI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    ap.add_argument("--streams", default="4,8,16", help="comma-separated concurrency levels")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per level (new streams start until then)")
    ap.add_argument("--ramp-s", type=float, default=2.0, help="worker start times are spread over this")
    ap.add_argument("--audio", default="synth", help="'synth' or a NeMo manifest (with text: WER)")
    ap.add_argument("--items", type=int, default=16, help="test set size")
    ap.add_argument("--endpointing", action="store_true", help="leave the server's endpointing on")
    ap.add_argument("--oracle-model", default=None, help="compare tokens with NeMo's loop on this model")
    ap.add_argument("--context-right", type=int, default=None)
    ap.add_argument("--stop-when-behind", action="store_true", help="stop after the first level that falls behind")
    ap.add_argument("--max-drift", type=float, default=20.0, help="ms/s of median drift still counted as keeping up")
    ap.add_argument("--procs", type=int, default=1, help="client processes (for large N)")
    ap.add_argument("--item-seconds", default="10,20", help="length range of the synthetic test items")
    ap.add_argument("--raw", default=None, help="also write every stream's record (JSON lines) here")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    record = run_record()
    items = test_set(args.audio, args.items, tuple(float(x) for x in args.item_seconds.split(",")))
    if args.oracle_model:
        attach_oracle(items, args.oracle_model, args.context_right)
    levels = []
    for n in [int(x) for x in args.streams.split(",")]:
        cpu0 = cpu_seconds_self()
        records = run_level_procs(args.url, items, n, args.duration, args.ramp_s, args.endpointing, args.procs)
        level = summarise_level(records, items, n, args.duration)
        level["loadgen_cpu_s"] = round(cpu_seconds_self() - cpu0, 2)
        level["keeps_up"] = keeps_up(level, args.max_drift)
        levels.append(level)
        print(format_level(level), file=sys.stderr)
        if args.raw:
            write_raw(args.raw, n, records)
        if args.stop_when_behind and not level["keeps_up"]:
            break
    write_json(args.out, {"benchmark": "loadgen", **record, "url": args.url, "audio": args.audio, "levels": levels})


def write_raw(path: str, n: int, records: list[StreamRecord]) -> None:
    with open(path, "a") as f:
        for r in records:
            row = {k: v for k, v in r.__dict__.items() if k != "finals"}
            row["streams"] = n
            row["finals"] = [{"token_ids": x["token_ids"], "recv": x["recv"]} for x in r.finals]
            f.write(json.dumps(row) + "\n")


def format_level(level: dict) -> str:
    p, f, d = level["partial_latency_ms"], level["final_latency_ms"], level["drift_ms_per_s"]
    q = level["quality"]
    quality = ""
    if "token_identical_streams" in q:
        quality = f", oracle-identical {q['token_identical_streams']}/{q['streams_compared']}"
    if "wer" in q:
        quality += f", WER {100 * q['wer']:.1f}%"
    return (
        f"N={level['streams']}: partial p50/p95/p99 {p['p50']}/{p['p95']}/{p['p99']} ms, "
        f"final p50/p95 {f['p50']}/{f['p95']} ms, drift {d['median'] if d['median'] is None else round(d['median'], 1)} ms/s, "
        f"completed {level['items_completed']}/{level['items_started']}, errors {level['errors'] or 0}{quality}"
        f" -> {'keeps up' if level.get('keeps_up') else 'BEHIND'}"
    )


if __name__ == "__main__":
    main()
