"""Host work per stream-step before and after a change, side by side: benchmarks/host_bench.py run
on two source trees, alternated level by level on one machine, merged into one result file.

    git archive <before> | tar -x -C /tmp/old; git archive <after> | tar -x -C /tmp/new
    python benchmarks/host_bench_ab.py --old /tmp/old --old-commit <before> --new /tmp/new \
        --new-commit <after> --streams 1000,4000,16000 --out benchmarks/results/host_bench_ab_cpu.json

Both trees run this tree's host_bench*.py (copied into each), so only the engine differs. Per
level (streams, chunk mode): the old tree, then the new one, `--reps` times. 1120 ms levels get
`--seconds-1120` of audio per stream (a few measured chunks), 80 ms levels `--seconds`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402

BENCH = sorted(Path(__file__).resolve().parent.glob("host_bench*.py"))  # host_bench.py and the modules it imports


def run_level(tree: Path, streams: int, context_right: int, seconds: float, args) -> list[dict]:
    for path in BENCH:
        shutil.copy(path, tree / "benchmarks" / path.name)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "benchmarks/host_bench.py", "--streams", str(streams), "--context-right", str(context_right),
               "--ready-fraction", args.ready_fraction, "--seconds", str(seconds), "--out", out.name]
        cmd += ["--overlap"] if args.overlap else []
        cmd += ["--profile"] if args.profile else []
        subprocess.run(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), check=True, capture_output=True)
        return json.loads(Path(out.name).read_text())["core"]


def summary(runs: list[dict]) -> list[dict]:
    """Per level and ready fraction: old and new side by side (medians over the reps) and new / old."""
    rows = {}
    for r in runs:
        key = (r["chunk_ms"], r["streams"], r["ready_fraction"])
        row = rows.setdefault(key, {"chunk_ms": key[0], "streams": key[1], "ready_fraction": key[2], "old": [], "new": []})
        row[r["kind"]].append(r)
    out = []
    for row in rows.values():
        for name in ("core_cpu_us_per_stream_step", "inprocess_cpu_us_per_stream_step", "core_gc_us_per_stream_step"):
            if name not in row["new"][0]:  # the collector's passes: measured since issue 46's third pass
                continue
            old = sorted(r[name] for r in row["old"])
            new = sorted(r[name] for r in row["new"])
            row[f"{name}_old"], row[f"{name}_new"] = old[len(old) // 2], new[len(new) // 2]
            row[f"{name}_new_over_old"] = round(new[len(new) // 2] / old[len(old) // 2], 3) if old[len(old) // 2] else None
        row["stub_tokens_per_frame"] = row["new"][0].get("core_stub_tokens_per_frame")
        row["budget_us_per_stream_step"] = row["new"][0]["budget_us_per_stream_step"]
        del row["old"], row["new"]
        out.append(row)
    return sorted(out, key=lambda r: (r["chunk_ms"], r["streams"], -r["ready_fraction"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, type=Path)
    p.add_argument("--new", required=True, type=Path)
    p.add_argument("--old-commit", default="")
    p.add_argument("--new-commit", default="")
    p.add_argument("--streams", default="1000,4000,16000")
    p.add_argument("--context-right", default="0,13")
    p.add_argument("--ready-fraction", default="1.0,0.1")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--seconds-1120", type=float, default=6.0)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--profile", action="store_true", help="host_bench.py --profile in both trees: each run's profile is in `runs`")
    p.add_argument("--notes", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    record = dict(run_record(), notes=args.notes, old_commit=args.old_commit, new_commit=args.new_commit, overlap=args.overlap)
    runs = []
    for n in [int(x) for x in args.streams.split(",")]:
        for r in [int(x) for x in args.context_right.split(",")]:
            seconds = args.seconds_1120 if r == 13 else args.seconds
            for rep in range(args.reps):
                for kind, tree in (("old", args.old), ("new", args.new)):
                    for e in run_level(tree, n, r, seconds, args):
                        runs.append(dict(e, kind=kind, rep=rep))
                        print(f"{kind} {n:6d} {e['chunk_ms']:5.0f} ms ready {e['ready_fraction']:.1f}: core "
                              f"{e['core_cpu_us_per_stream_step']:.2f} us, in-process {e['inprocess_cpu_us_per_stream_step']:.2f} us", flush=True)
    write_json(args.out, {"run": record, "summary": summary(runs), "runs": runs})


if __name__ == "__main__":
    main()
