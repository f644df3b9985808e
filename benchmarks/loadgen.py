"""Load generator: N concurrent WebSocket streams at real-time pace against a running nemo-serve.

    python benchmarks/loadgen.py --url ws://127.0.0.1:8000/ws --streams 4,8,16 --duration 60 \
        --audio synth --oracle-model builtin:fastconformer-l --context-right 13 --out load.json

The N streams ("lanes") run in --workers processes (default: half the cores), each an event loop
(uvloop where installed) driving lanes p, p+W, ... (benchmarks/load_workers.py). Each lane starts
at a staggered time (spread over --ramp-s), walks the test set from its own starting item (lane w
starts at item w*K/N), and streams one item per WebSocket:
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
  errors           refusals, error messages, abnormal closes and timeouts, by kind;
  --protocol realtime  the same over /v1/realtime (benchmarks/load_realtime.py): 20 ms PCM16
                   appends, one commit per item; final latency and tokens, no partial latency
                   (deltas carry no audio position), so its keep-up rule uses the finals;
  client           --client picows (default where installed; load_picows.py) or websockets: the
                   same protocol steps and checks, picows at less CPU per packet;
  send lateness    per worker process, how long after its due time each packet got the loop
                   (load_level.send_paced); a level where a worker's p99 passed
                   --max-send-lateness-ms is `generator_late`: invalid, neither kept up nor behind.
Before a level starts the open-file limit is raised (soft to hard) and checked against the lanes
per worker.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks.load_items import attach_oracle, make_items  # noqa: E402
from benchmarks.load_level import CLIENTS, StreamRecord, default_client  # noqa: E402
from benchmarks.load_summary import format_level  # noqa: E402
from benchmarks.load_realtime import on_pcm16_grid  # noqa: E402
from benchmarks.load_workers import DEFAULT_MAX_SEND_LATENESS_MS, default_workers, lateness_line, measure_level  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/ws", help="/ws, or /v1/realtime with --protocol realtime")
    ap.add_argument("--protocol", default="ws", choices=["ws", "realtime"],
                    help="realtime: OpenAI's guide flow, 20 ms PCM16 appends and a commit per item (load_realtime.py)")
    ap.add_argument("--client", default=default_client(), choices=CLIENTS,
                    help="picows (default where installed): prebuilt payloads, messages read in picows's frame callback "
                         "(load_picows.py); websockets: its asyncio client, the generator's first client")
    ap.add_argument("--streams", default="4,8,16", help="comma-separated concurrency levels")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per level (new streams start until then)")
    ap.add_argument("--ramp-s", type=float, default=2.0, help="worker start times are spread over this")
    ap.add_argument("--audio", default="synth", help="'synth' or a NeMo manifest (with text: WER)")
    ap.add_argument("--items", type=int, default=16, help="test set size")
    ap.add_argument("--endpointing", action="store_true", help="leave the server's endpointing on")
    ap.add_argument("--oracle-model", default=None, help="compare tokens with NeMo's loop on this model")
    ap.add_argument("--context-right", type=int, default=None)
    ap.add_argument("--stop-when-behind", action="store_true", help="stop after the first level that falls behind")
    ap.add_argument("--max-drift", type=float, default=20.0, help="ms/s of drift (90th percentile over streams) still counted as keeping up")
    ap.add_argument("--workers", "--procs", type=int, default=default_workers(),
                    help="load generator processes (default: half the cores)")
    ap.add_argument("--max-send-lateness-ms", type=float, default=DEFAULT_MAX_SEND_LATENESS_MS,
                    help="a worker whose p99 send lateness passes this makes the level invalid (generator_late)")
    ap.add_argument("--item-seconds", default="10,20", help="length range of the synthetic test items")
    ap.add_argument("--raw", default=None, help="also write every stream's record (JSON lines) here")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    record = run_record()
    items = make_items(args.audio, args.items, tuple(float(x) for x in args.item_seconds.split(",")))
    if args.protocol == "realtime":  # PCM16 on the wire: the oracle's audio is what the server reads back
        for it in items:
            it.audio = on_pcm16_grid(it.audio)
    if args.oracle_model:
        attach_oracle(items, args.oracle_model, args.context_right)
    levels = []
    for n in [int(x) for x in args.streams.split(",")]:
        level, run = measure_level(args.url, items, n, args.duration, ramp_s=args.ramp_s, endpointing=args.endpointing,
                                   num_workers=args.workers, context_right=args.context_right, max_drift=args.max_drift,
                                   max_send_lateness_ms=args.max_send_lateness_ms, protocol=args.protocol,
                                   client=args.client)  # fmt: skip
        levels.append(level)
        print(format_level(level), file=sys.stderr)
        print(lateness_line(level), file=sys.stderr)
        if args.raw:
            write_raw(args.raw, n, run.records)
        if args.stop_when_behind and not level["keeps_up"]:
            break
    write_json(args.out, {"benchmark": "loadgen", **record, "url": args.url, "protocol": args.protocol, "client": args.client, "audio": args.audio,
                          "workers": args.workers, "levels": levels})  # fmt: skip


def write_raw(path: str, n: int, records: list[StreamRecord]) -> None:
    with open(path, "a") as f:
        for r in records:
            row = {k: v for k, v in r.__dict__.items() if k != "finals"}
            row["streams"] = n
            row["finals"] = [{"token_ids": x["token_ids"], "recv": x["recv"]} for x in r.finals]
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
