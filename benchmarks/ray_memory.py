"""Resident memory of a one-replica nemo-serve Ray Serve deployment, by process (docs/ray_serve.md,
"Many hosts on Ray Serve"): the replica (the front end), its engine-core process (the demo model)
and Ray's own processes on the head node.

    python benchmarks/ray_memory.py          # needs the ray extra: pip install -e '.[ray]'
"""

from __future__ import annotations

import os
import subprocess
import time

import ray
from ray import serve

from nemo_serve.ray_serve import application


def by_process() -> dict[str, float]:
    """MiB resident per kind of process: the replica, Serve's controller and proxy, Ray's daemons."""
    out: dict[str, float] = {}
    rows = [line.strip().split(None, 3) for line in
            subprocess.run(["ps", "-eo", "pid,ppid,rss,args"], capture_output=True, text=True).stdout.splitlines()[1:]]  # fmt: skip
    replicas = {pid for pid, _, _, args in rows if "ServeReplica" in args}
    for pid, ppid, rss, args in rows:
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
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 18123})
    serve.run(application(num_slots=2, replicas=1, env={"NEMO_SERVE_LOG_LEVEL": "warning"}, cpus=0.5),
              name="nemo-serve", route_prefix="/")  # fmt: skip
    time.sleep(5)
    for key, mib in sorted(by_process().items(), key=lambda kv: -kv[1]):
        print(f"{mib:8.0f} MiB  {key}")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
