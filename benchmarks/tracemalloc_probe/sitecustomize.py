"""Where a front end's memory goes under a soak (benchmarks/soak.py), without touching the server.

With this folder on PYTHONPATH and TRACEMALLOC_PROBE_DIR set, every Python process started runs a
daemon thread that waits until it is a front end (nemo_serve.server.runner imported, as in
benchmarks/gc_probe), then starts tracemalloc (TRACEMALLOC_PROBE_FRAMES frames), takes a baseline
snapshot TRACEMALLOC_PROBE_BASELINE_S seconds later (TRACEMALLOC_PROBE_FRAMES=0: no tracing,
only what follows) and, every TRACEMALLOC_PROBE_EVERY_S after
that, writes TRACEMALLOC_PROBE_DIR/<pid>.json: tracemalloc's traced total at the baseline and
now, the top growth by traceback, the gc-tracked objects by type at both (asyncio tasks among
them), glibc's heap in use and held free, and the RSS. A front end ends with os._exit (no atexit), so the last file written is the
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

    def _malloc_kib() -> dict:
        """glibc's heap (mallinfo2): in use by malloc callers, native libraries included, against
        held free: the second growing alone is the allocator keeping freed memory, not a leak."""
        import ctypes

        class _Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip

        try:
            mallinfo2 = ctypes.CDLL(None).mallinfo2
        except AttributeError:  # not glibc >= 2.33
            return {}
        mallinfo2.restype = _Info
        i = mallinfo2()
        return {"heap": i.arena // 1024, "in_use": (i.uordblks + i.hblkhd) // 1024, "free_held": i.fordblks // 1024}

    def _rss_mib() -> float:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        return round(kib / 1024, 2)

    def _growth(base: tracemalloc.Snapshot, now: tracemalloc.Snapshot) -> tuple[int, int, list[dict]]:
        """Traced bytes at the baseline and now, and the top growth by traceback, all without what
        the probe allocated itself (its counts, records, linecache lines for the tracebacks)."""
        mine = [tracemalloc.Filter(False, __file__, all_frames=True)]
        base, now = base.filter_traces(mine), now.filter_traces(mine)
        stats = now.compare_to(base, "traceback")
        stats.sort(key=lambda s: s.size_diff, reverse=True)
        top = [{"size_diff_kib": round(s.size_diff / 1024, 1), "count_diff": s.count_diff,
                "size_kib": round(s.size / 1024, 1), "traceback": [str(fr) for fr in s.traceback.format()][-2 * _FRAMES:]}
               for s in stats[:_TOP]]  # fmt: skip
        return sum(s.size for s in base.statistics("filename")), sum(s.size for s in now.statistics("filename")), top

    def _write(record: dict) -> None:
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)

    def _probe() -> None:
        while "nemo_serve.server.runner" not in sys.modules:
            time.sleep(0.5)
        if _FRAMES:  # 0: object counts and the allocator only, RSS as in the soak
            tracemalloc.start(_FRAMES)
        started = time.monotonic()
        time.sleep(_BASELINE_S)
        gc.collect()
        # counted while no snapshot is alive (a snapshot holds one tuple per trace), and the
        # baseline kept on disk between comparisons for the same reason
        base_types, base_rss, base_malloc = _objects_by_type(), _rss_mib(), _malloc_kib()
        base_path = os.path.join(_DIR, f"{os.getpid()}.baseline")
        if _FRAMES:
            tracemalloc.take_snapshot().dump(base_path)
        malloc_series = []  # [[s since up, in use KiB, free held KiB, RSS MiB], ...]: every pass, not only the last
        while True:
            time.sleep(_EVERY_S)
            gc.collect()  # cycles the collector would free anyway are not growth
            types = _objects_by_type()
            base_traced, traced, growth = 0, 0, []
            if _FRAMES:
                now = tracemalloc.take_snapshot()  # before the baseline is loaded: its traces are not the process's
                base_traced, traced, growth = _growth(tracemalloc.Snapshot.load(base_path), now)
                del now  # alive into the next pass, its traces would count as the process's objects
            now_malloc = _malloc_kib()
            malloc_series.append([round(time.monotonic() - started, 1), now_malloc.get("in_use"),
                                  now_malloc.get("free_held"), _rss_mib()])  # fmt: skip
            diff = Counter(types)
            diff.subtract(base_types)
            _write({
                "pid": os.getpid(),
                "baseline_at_s": round(_BASELINE_S, 1),
                "now_at_s": round(time.monotonic() - started, 1),
                "traced_kib": {"baseline": round(base_traced / 1024, 1), "now": round(traced / 1024, 1)},
                "rss_mib": {"baseline": base_rss, "now": _rss_mib()},
                "malloc_kib": {"baseline": base_malloc, "now": now_malloc},
                "malloc_series": malloc_series,
                "gc_objects": {"baseline": sum(base_types.values()), "now": sum(types.values())},
                "asyncio_tasks": {"baseline": sum(n for t, n in base_types.items() if t.endswith(".Task")),
                                  "now": sum(n for t, n in types.items() if t.endswith(".Task"))},
                "gc_objects_growth_by_type": dict(diff.most_common(_TOP)),
                "top_growth_by_traceback": growth,
            })  # fmt: skip
            del types, diff, growth  # nor these

    threading.Thread(target=_probe, daemon=True, name="tracemalloc-probe").start()
