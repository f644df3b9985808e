"""Where a front end's memory goes under a soak (benchmarks/soak.py), without touching the server.

With this folder on PYTHONPATH and TRACEMALLOC_PROBE_DIR set, every Python process started runs a
daemon thread that waits until it is a front end (nemo_serve.server.runner imported, as in
benchmarks/gc_probe), then starts tracemalloc (TRACEMALLOC_PROBE_FRAMES frames), takes a baseline
snapshot TRACEMALLOC_PROBE_BASELINE_S seconds later and, every TRACEMALLOC_PROBE_EVERY_S after
that, writes TRACEMALLOC_PROBE_DIR/<pid>.json: tracemalloc's traced total at the baseline and
now, the top growth by traceback, the gc-tracked objects by type at both (asyncio tasks among
them) and the RSS. A front end ends with os._exit (no atexit), so the last file written is the
end. Nothing here runs when the variable is unset."""

import os

if os.environ.get("TRACEMALLOC_PROBE_DIR"):
    import gc
    import json
    import sys
    import threading
    import time
    import tracemalloc
    from collections import Counter

    _DIR = os.environ["TRACEMALLOC_PROBE_DIR"]
    _FRAMES = int(os.environ.get("TRACEMALLOC_PROBE_FRAMES", "12"))
    _BASELINE_S = float(os.environ.get("TRACEMALLOC_PROBE_BASELINE_S", "60"))
    _EVERY_S = float(os.environ.get("TRACEMALLOC_PROBE_EVERY_S", "30"))
    _TOP = 25

    def _objects_by_type() -> Counter:
        return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())

    def _rss_mib() -> float:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        return round(kib / 1024, 2)

    def _growth(base: tracemalloc.Snapshot, now: tracemalloc.Snapshot) -> list[dict]:
        mine = [tracemalloc.Filter(False, __file__, all_frames=True)]  # the probe's own counting
        stats = now.filter_traces(mine).compare_to(base.filter_traces(mine), "traceback")
        stats.sort(key=lambda s: s.size_diff, reverse=True)
        return [{"size_diff_kib": round(s.size_diff / 1024, 1), "count_diff": s.count_diff,
                 "size_kib": round(s.size / 1024, 1), "traceback": [str(fr) for fr in s.traceback.format()][-2 * _FRAMES:]}
                for s in stats[:_TOP]]  # fmt: skip

    def _write(record: dict) -> None:
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)

    def _probe() -> None:
        while "nemo_serve.server.runner" not in sys.modules:
            time.sleep(0.5)
        tracemalloc.start(_FRAMES)
        started = time.monotonic()
        time.sleep(_BASELINE_S)
        gc.collect()
        # counted while no snapshot is alive (a snapshot holds one tuple per trace), and the
        # baseline kept on disk between comparisons for the same reason
        base_types, base_rss = _objects_by_type(), _rss_mib()
        base_traced = tracemalloc.get_traced_memory()[0]
        base_path = os.path.join(_DIR, f"{os.getpid()}.baseline")
        tracemalloc.take_snapshot().dump(base_path)
        while True:
            time.sleep(_EVERY_S)
            gc.collect()  # cycles the collector would free anyway are not growth
            types = _objects_by_type()
            traced = tracemalloc.get_traced_memory()[0]
            now = tracemalloc.take_snapshot()  # before the baseline is loaded: its traces are not the process's
            growth = _growth(tracemalloc.Snapshot.load(base_path), now)
            diff = Counter(types)
            diff.subtract(base_types)
            _write({
                "pid": os.getpid(),
                "baseline_at_s": round(_BASELINE_S, 1),
                "now_at_s": round(time.monotonic() - started, 1),
                "traced_kib": {"baseline": round(base_traced / 1024, 1), "now": round(traced / 1024, 1)},
                "rss_mib": {"baseline": base_rss, "now": _rss_mib()},
                "gc_objects": {"baseline": sum(base_types.values()), "now": sum(types.values())},
                "asyncio_tasks": {"baseline": sum(n for t, n in base_types.items() if t.endswith(".Task")),
                                  "now": sum(n for t, n in types.items() if t.endswith(".Task"))},
                "gc_objects_growth_by_type": dict(diff.most_common(_TOP)),
                "top_growth_by_traceback": growth,
            })  # fmt: skip

    threading.Thread(target=_probe, daemon=True, name="tracemalloc-probe").start()
