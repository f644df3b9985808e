"""Is a front end's slow RSS growth under the soak Python objects kept per stream, or not?

    nice -n 5 python -m benchmarks.soak_tracemalloc --minutes 4 --out benchmarks/results/soak_tracemalloc_cpu.json

runs benchmarks/soak.py with benchmarks/tracemalloc_probe on the server's PYTHONPATH: each front
end traces its allocations from when it is up, takes a baseline `--baseline-s` later (about a
minute into the churn) and writes its growth since then every 30 s (tracemalloc's traced total,
the top growth by traceback, gc-tracked objects by type, asyncio tasks alive). The JSON holds the
soak's own report under "soak" and each front end's last probe record under "frontends". RSS under
tracemalloc is not the soak's RSS (the traces cost memory): read traced_kib and the object counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import soak  # noqa: E402

PROBE = Path(__file__).resolve().parent / "tracemalloc_probe"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--baseline-s", type=float, default=90.0, help="after a front end is up (start-up and references ~30 s)")
    p.add_argument("--frames", type=int, default=12, help="traceback depth; 0: no tracemalloc (RSS as in the soak)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    probe_dir = tempfile.mkdtemp(prefix="tracemalloc-probe-")
    os.environ.update(TRACEMALLOC_PROBE_DIR=probe_dir, TRACEMALLOC_PROBE_BASELINE_S=str(args.baseline_s),
                      TRACEMALLOC_PROBE_FRAMES=str(args.frames))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(PROBE)]))
    soak_out = Path(probe_dir) / "soak.json"
    code = soak.main(["--minutes", str(args.minutes), "--out", str(soak_out)])
    frontends = {f.stem: json.loads(f.read_text()) for f in sorted(Path(probe_dir).glob("[0-9]*.json"))}
    if not frontends:
        raise SystemExit(f"no probe record in {probe_dir}: is the churn longer than --baseline-s + 30 s?")
    from benchmarks.common import run_record

    report = {"run": run_record(), "soak": json.loads(soak_out.read_text()), "frontends": frontends}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for pid, r in frontends.items():
        print(f"front end {pid}: traced {r['traced_kib']} KiB at {r['baseline_at_s']} s / {r['now_at_s']} s, "
              f"gc objects {r['gc_objects']}, asyncio tasks {r['asyncio_tasks']}, RSS {r['rss_mib']} MiB, "
              f"malloc {r['malloc_kib']} KiB")  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
