"""What one malloc_trim(0) costs a front end's event loop, and what it gives back (nemo_serve/server/heap_trim.py).

    nice -n 5 python -m benchmarks.heap_trim_cost --out benchmarks/results/heap_trim_cost_cpu.json

In a fresh process per case: allocate `--heap-mib` of 1 KiB bytes objects (above pymalloc's 512 B,
so from glibc's heap, as a front end's packets and JSON are), then free all but one in `--keep-every`
(a fragmented heap: free pages between live blocks, which free() alone keeps) or none (an intact
heap: nothing to give back, the walk alone), and time malloc_trim(0) `--repeats` times. The first call
releases the pages; the later ones find nothing left, which is the steady cost of a periodic trim.
RSS before and after the first call says what came back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK_BYTES = 1024


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def one_case(heap_mib: int, keep_every: int, repeats: int) -> dict:
    """Run in its own process: the heap, the frees, the timed trims."""
    from nemo_serve.server.heap_trim import load_malloc_trim

    trim = load_malloc_trim()
    if trim is None:
        raise SystemExit("no malloc_trim here (not glibc)")
    blocks = [bytes(BLOCK_BYTES) for _ in range(heap_mib * 2**20 // BLOCK_BYTES)]
    if keep_every:
        blocks = blocks[::keep_every]  # the rest freed; one live block in each run of them pins the pages around it
    before = rss_mib()
    times_ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        trim()
        times_ms.append((time.perf_counter() - t) * 1e3)
        if len(times_ms) == 1:
            after_first = rss_mib()
    return {"heap_mib": heap_mib, "keep_every": keep_every, "live_blocks": len(blocks),
            "rss_before_mib": round(before, 1), "rss_after_first_trim_mib": round(after_first, 1),
            "first_trim_ms": round(times_ms[0], 3), "later_trims_median_ms": round(statistics.median(times_ms[1:]), 3),
            "later_trims_max_ms": round(max(times_ms[1:]), 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heap-mib", type=int, default=100)
    p.add_argument("--keep-every", type=int, default=16, help="one live block in this many; 0 in the intact case")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--runs", type=int, default=3, help="fresh processes per case")
    p.add_argument("--case", nargs=2, type=int, metavar=("HEAP_MIB", "KEEP_EVERY"), help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.case:  # the child
        print(json.dumps(one_case(*args.case, args.repeats)))
        return 0
    cases = {"fragmented": args.keep_every, "intact": 0}
    results = {name: [] for name in cases}
    for _ in range(args.runs):  # the cases alternate, so load on the machine falls on both
        for name, keep in cases.items():
            cmd = [sys.executable, "-m", "benchmarks.heap_trim_cost", "--case", str(args.heap_mib), str(keep),
                   "--repeats", str(args.repeats)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
            results[name].append(json.loads(out.stdout))
    for name, runs in results.items():
        print(f"{name:10s} RSS {[r['rss_before_mib'] for r in runs]} -> {[r['rss_after_first_trim_mib'] for r in runs]} MiB; "
              f"first trim {[r['first_trim_ms'] for r in runs]} ms, later {[r['later_trims_median_ms'] for r in runs]} ms")  # fmt: skip
    if args.out:
        from benchmarks.common import run_record

        report = {"run": run_record(), "block_bytes": BLOCK_BYTES, "cases": results}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
