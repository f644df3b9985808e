"""Times the cyclic collector's passes in every process started with this folder on PYTHONPATH
and GC_PROBE_DIR set (benchmarks/frontend_gc.py): per generation, how many passes, their CPU and wall time,
written to GC_PROBE_DIR/<pid>.json twice a second by a daemon thread (a front end ends with
os._exit: no atexit); the heap the collector tracks once, when GC_PROBE_DIR/measure-heap
appears. Which process is a front end is read from what it imported."""

import os

if os.environ.get("GC_PROBE_DIR"):
    import gc
    import json
    import sys
    import threading
    import time

    # seconds: the collecting thread's CPU (what a packet pays on a shared machine); wall_seconds:
    # how long the pass held the event loop, preemption by other processes included
    _totals = {"passes": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "wall_seconds": [0.0, 0.0, 0.0]}
    _started = [0.0, 0.0]

    def _on_gc(phase, info):
        if phase == "start":
            _started[:] = time.thread_time(), time.perf_counter()
        else:
            gen = info["generation"]
            _totals["passes"][gen] += 1
            _totals["seconds"][gen] += time.thread_time() - _started[0]
            _totals["wall_seconds"][gen] += time.perf_counter() - _started[1]

    def _dump_forever(path):
        heap = None
        while True:
            time.sleep(0.5)
            serving = "nemo_serve.server.runner" in sys.modules
            if serving and heap is None and os.path.exists(os.path.join(os.environ["GC_PROBE_DIR"], "measure-heap")):
                # once, when the server is up and before the traffic (frontend_gc.py makes the file)
                heap = {"tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count(),
                        "threshold": gc.get_threshold()}
            record = dict(_totals, pid=os.getpid(), frontend=serving, heap=heap)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)

    gc.callbacks.append(_on_gc)
    _path = os.path.join(os.environ["GC_PROBE_DIR"], f"{os.getpid()}.json")
    threading.Thread(target=_dump_forever, args=(_path,), daemon=True, name="gc-probe").start()
