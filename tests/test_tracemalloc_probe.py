"""benchmarks/tracemalloc_probe: a process that keeps objects shows them as growth, by traceback
and by type, and the probe's own snapshots are not counted among its objects."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROBE = Path(__file__).resolve().parent.parent / "benchmarks" / "tracemalloc_probe"

# a stand-in front end: it "imports" the runner, then keeps one object per "stream"
LEAKY = """
import sys, time, types
sys.modules["nemo_serve.server.runner"] = types.ModuleType("runner")
class KeptPerStream:
    pass
kept = []
while True:
    kept.extend(KeptPerStream() for _ in range(200))
    time.sleep(0.05)
"""


def run_probe(tmp_path, env_extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")]), **env_extra}
    proc = subprocess.Popen([sys.executable, "-c", LEAKY], env=env)
    try:
        deadline = time.monotonic() + 20
        records = []
        while time.monotonic() < deadline and not records:
            time.sleep(0.3)
            records = [json.loads(f.read_text()) for f in tmp_path.glob("*.json")]
        return records
    finally:
        proc.kill()
        proc.wait()


def test_kept_objects_show_as_growth(tmp_path):
    records = run_probe(tmp_path, {"TRACEMALLOC_PROBE_DIR": str(tmp_path), "TRACEMALLOC_PROBE_BASELINE_S": "0.5",
                                   "TRACEMALLOC_PROBE_EVERY_S": "1"})  # fmt: skip
    assert len(records) == 1
    r = records[0]
    assert r["gc_objects_growth_by_type"].get("__main__.KeptPerStream", 0) >= 1000
    assert r["traced_kib"]["now"] > r["traced_kib"]["baseline"]
    assert r["malloc_kib"]["now"]["in_use"] > 0  # glibc's heap read (mallinfo2)
    top = r["top_growth_by_traceback"][0]
    keeping_line = LEAKY.splitlines().index("    kept.extend(KeptPerStream() for _ in range(200))") + 1
    assert f'File "<string>", line {keeping_line}' in top["traceback"][-1], top
    # the probe's own snapshots are not counted as the process's objects
    assert r["gc_objects_growth_by_type"].get("builtins.tuple", 0) < 1000



QUIET = """
import sys, time, types
sys.modules["nemo_serve.server.runner"] = types.ModuleType("runner")
while True:
    time.sleep(0.05)
"""


def test_a_quiet_process_shows_no_growth_pass_after_pass(tmp_path):
    """The second and later records too: no snapshot of the probe's own is alive when it counts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")]),
           "TRACEMALLOC_PROBE_DIR": str(tmp_path), "TRACEMALLOC_PROBE_BASELINE_S": "0.3",
           "TRACEMALLOC_PROBE_EVERY_S": "0.5"}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", QUIET], env=env)
    try:
        deadline, r = time.monotonic() + 20, None
        while time.monotonic() < deadline and (r is None or r["now_at_s"] < 2.0):
            time.sleep(0.3)
            files = list(tmp_path.glob("*.json"))
            r = json.loads(files[0].read_text()) if files else None
    finally:
        proc.kill()
        proc.wait()
    assert r is not None and r["now_at_s"] >= 2.0
    assert r["gc_objects_growth_by_type"].get("builtins.tuple", 0) < 100
    assert r["traced_kib"]["now"] - r["traced_kib"]["baseline"] < 50
