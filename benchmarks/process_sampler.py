"""CPU seconds and resident memory of a server's whole process tree, and its GPU memory, sampled
in a thread: what sweep.py, mode_mix.py and gpu/server_capacity.py record beside their load."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.server_process import process_tree


def tree_cpu_rss(pid: int, tick: int) -> tuple[float, float, dict[int, float]]:
    """(CPU seconds, RSS MiB, {pid: CPU seconds}) summed over the process tree under `pid`.
    CPU of children that already exited is not counted (their time goes to cutime of a parent
    that waited for them; the server's processes live as long as the server). Raises OSError
    when `pid` itself is gone."""
    cpu_total, rss_total, per = 0.0, 0.0, {}
    for p in process_tree(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            rss_kib = next(int(ln.split()[1]) for ln in Path(f"/proc/{p}/status").read_text().splitlines() if ln.startswith("VmRSS"))
        except (OSError, StopIteration, IndexError):
            if p == pid:
                raise OSError(f"process {pid} is gone")
            continue  # a child that just exited
        cpu = (int(stat[11]) + int(stat[12])) / tick  # utime + stime
        per[p] = cpu
        cpu_total += cpu
        rss_total += rss_kib / 1024
    return cpu_total, rss_total, per


class Sampler(threading.Thread):
    """CPU seconds and RSS summed over a process and all its descendants (the supervisor, the
    engine core, the front ends) from /proc, GPU memory from nvidia-smi, every period_s."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="sampler")
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, float, float, float | None]] = []  # (wall, cpu_s, rss_mib, gpu_mib)
        self.per_process: list[tuple[float, dict[int, float]]] = []  # (wall, {pid: cpu_s})
        self._stopped = threading.Event()  # not `_stop`: that is Thread._stop, which a fork (the load generator's workers) calls
        self._tick = os.sysconf("SC_CLK_TCK")
        self._smi = shutil.which("nvidia-smi")

    def run(self) -> None:
        n = 0
        gpu = None
        while not self._stopped.is_set():
            try:
                cpu, rss, per = tree_cpu_rss(self.pid, self._tick)
            except OSError:
                return
            if self._smi and n % 4 == 0:
                gpu = self._gpu_mib()
            now = time.time()
            self.samples.append((now, cpu, rss, gpu))
            self.per_process.append((now, per))
            n += 1
            self._stopped.wait(self.period_s)

    def _gpu_mib(self) -> float | None:
        try:
            out = subprocess.run(
                [self._smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5,
            ).stdout  # fmt: skip
            for line in out.splitlines():
                pid, mem = [x.strip() for x in line.split(",")]
                if int(pid) in process_tree(self.pid):
                    return float(mem)
            out = subprocess.run(
                [self._smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5
            ).stdout
            return float(out.split()[0])  # per-process figures unavailable (containers): the whole GPU
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def window(self, t0: float, t1: float) -> dict:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {}
        (w0, c0, _, _), (w1, c1, _, _) = inside[0], inside[-1]
        gpus = [s[3] for s in inside if s[3] is not None]
        per = [p for p in self.per_process if t0 <= p[0] <= t1]
        by_pid = {}
        if len(per) >= 2:
            (pw0, p0), (pw1, p1) = per[0], per[-1]
            by_pid = {str(k): round((v - p0.get(k, 0.0)) / (pw1 - pw0), 2) for k, v in p1.items()}
        return {
            "server_cpu_cores": round((c1 - c0) / (w1 - w0), 2),
            "server_cpu_cores_by_pid": by_pid,
            "server_rss_mib_max": round(max(s[2] for s in inside), 1),
            "gpu_mem_mib_max": max(gpus) if gpus else None,
        }

    def stop(self) -> None:
        self._stopped.set()

