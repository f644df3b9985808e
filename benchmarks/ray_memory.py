"""Resident memory of a one-replica nemo-serve Ray Serve deployment, by process (docs/ray_serve.md,
"Many hosts on Ray Serve"): the replica (the front end), its engine-core process (the demo model)
and Ray's own processes on the head node.

    python benchmarks/ray_memory.py --out benchmarks/results/ray_memory_demo_cpu.json   # needs: pip install -e '.[ray]'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record  # noqa: E402
from nemo_serve.ray_serve import application  # noqa: E402


def by_process() -> dict[str, float]:
    """MiB resident per kind of process: the replica, Serve's controller and proxy, Ray's daemons."""
    out: dict[str, float] = {}
    rows = [line.strip().split(None, 3) for line in
            subprocess.run(["ps", "-eo", "pid,ppid,rss,args"], capture_output=True, text=True).stdout.splitlines()[1:]]  # fmt: skip
    replicas = {pid for pid, _, _, args in rows if "ServeReplica" in args}
    parent = {pid: ppid for pid, ppid, _, _ in rows}

    def ours(pid: str) -> bool:
        """Started by this script (its Ray daemons and workers): another Ray on the host is not counted."""
        while pid in parent and pid != "1":
            if pid == str(os.getpid()):
                return True
            pid = parent[pid]
        return False

    for pid, ppid, rss, args in rows:
        if not ours(pid):
            continue
        if int(pid) == os.getpid():
            key = "this script (Ray driver)"
        elif "ServeReplica" in args:
            key = "replica"
        elif ppid in replicas and "spawn_main" in args:
            key = "replica's engine core"
        elif "ProxyActor" in args:
            key = "proxy"
        elif "ServeController" in args:
            key = "controller"
        elif "ray" in args:
            key = args.split()[0].rsplit("/", 1)[-1][:40]
        else:
            continue
        out[key] = out.get(key, 0.0) + int(rss) / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the figures as JSON, with the run record")
    args = ap.parse_args()
    record = run_record()  # before Ray starts: the command, commit and load of this run
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 18123})
    serve.run(application(num_slots=2, replicas=1, env={"NEMO_SERVE_LOG_LEVEL": "warning"}, cpus=0.5),
              name="nemo-serve", route_prefix="/")  # fmt: skip
    time.sleep(5)
    mib_by_process = dict(sorted(by_process().items(), key=lambda kv: -kv[1]))
    for key, mib in mib_by_process.items():
        print(f"{mib:8.0f} MiB  {key}")
    if args.out:
        Path(args.out).write_text(json.dumps({"run": record, "mib_by_process": mib_by_process}, indent=1) + "\n")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
