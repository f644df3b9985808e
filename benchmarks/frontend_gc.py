"""How much of a front end's CPU per paced packet is the cyclic collector (issue 48, item 2).

    python benchmarks/frontend_gc.py --paths ws_s16_20ms,grpc_20ms --streams 32 \
        --out benchmarks/results/frontend_gc_cpu.json

packet_cost.py's servers and paced paths (real sockets, --frontends 1), with every server process
started with benchmarks/gc_probe/ on PYTHONPATH: its sitecustomize times each collector pass
(gc.callbacks) per generation, in CPU of the collecting thread and in wall time. For each path the front end's passes and their time over the paced
window, divided by the packets sent, beside packet_cost's CPU per packet; and the heap the
collector tracks in the front end once it serves (objects tracked, objects frozen). --tree
LABEL=PATH twice compares two trees side by side, as packet_cost.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks.packet_clients import RATE, speech  # noqa: E402
from benchmarks.packet_cost import Target, _commit, measure  # noqa: E402

PROBE = Path(__file__).resolve().parent / "gc_probe"


def probe(probe_dir: Path, pid: int) -> dict:
    for _ in range(50):
        try:
            return json.loads((probe_dir / f"{pid}.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
    raise RuntimeError(f"no collector probe from front end {pid}: is benchmarks/gc_probe on its PYTHONPATH?")


def collector_per_packet(before: dict, after: dict, packets: int) -> dict:
    passes = [a - b for a, b in zip(after["passes"], before["passes"])]
    seconds = [a - b for a, b in zip(after["seconds"], before["seconds"])]
    wall = [a - b for a, b in zip(after["wall_seconds"], before["wall_seconds"])]
    return {
        "passes_by_generation": passes,
        "collector_cpu_ms_by_generation": [round(1e3 * s, 2) for s in seconds],
        "collector_wall_ms_by_generation": [round(1e3 * s, 2) for s in wall],  # preemption included
        "passes_per_1000_packets": round(1e3 * sum(passes) / max(packets, 1), 2),
        "collector_us_per_packet": round(1e6 * sum(seconds) / max(packets, 1), 2),
    }


def run_tree(targets: list[Target], probe_dir: Path, args, x_by_rate: dict) -> dict:
    rows: dict = {t.label: {"paths": {}} for t in targets}
    (probe_dir / "measure-heap").touch()
    time.sleep(1.5)
    for t in targets:
        rows[t.label]["startup_heap"] = probe(probe_dir, t.fe_pids[0])["heap"]
    paths = args.paths.split(",")
    for rep in range(args.repeats):
        for path in paths if rep % 2 == 0 else paths[::-1]:
            for t in targets if rep % 2 == 0 else targets[::-1]:
                time.sleep(0.6)  # the probe's last write in
                before = probe(probe_dir, t.fe_pids[0])
                r = measure(path, t, args, t.idle_cores, x_by_rate)
                time.sleep(0.6)
                r.update(collector_per_packet(before, probe(probe_dir, t.fe_pids[0]), r["packets"]))
                print(f"{t.label:8s} {path:30s} collector {r['collector_us_per_packet']:6.2f} us/packet "
                      f"({r['passes_by_generation']} passes, {r['collector_cpu_ms_by_generation']} ms CPU, "
                      f"{r['collector_wall_ms_by_generation']} ms wall)", flush=True)
                rows[t.label]["paths"].setdefault(path, []).append(r)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nemo_serve/assets/demo/demo.nemo")
    p.add_argument("--context-right", type=int, default=3)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--paths", default="ws_s16_20ms,ws_s16_20ms_fast,realtime_24k_20ms_novad_fast,grpc_20ms")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--tree", action="append", default=None, metavar="LABEL=PATH")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.env_of, args.fast_ws = {}, any(x.endswith("_fast") for x in args.paths.split(","))
    probe_dir = Path(tempfile.mkdtemp(prefix="gc-probe-"))
    os.environ["GC_PROBE_DIR"] = str(probe_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(PROBE)]))
    out_dir = Path(args.out).parent if args.out else Path("/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    x_by_rate = {RATE: speech("nemo_serve/assets/demo/utterances/manifest.jsonl", RATE)}
    x_by_rate[24000] = speech("nemo_serve/assets/demo/utterances/manifest.jsonl", 24000)
    trees = [t.split("=", 1) for t in args.tree or [f"this={Path(__file__).resolve().parent.parent}"]]
    targets = [Target(1, label, str(Path(tree).resolve()), args, out_dir) for label, tree in trees]
    try:
        for t in targets:
            t.ready(args.idle_s)
        rows = run_tree(targets, probe_dir, args, x_by_rate)
    finally:
        for t in targets:
            t.server.stop()
    result = {"run": run_record(), "streams": args.streams, "seconds": args.seconds,
              "trees": [{"tree": t.label, "tree_commit": _commit(t.tree), **rows[t.label]} for t in targets]}  # fmt: skip
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
