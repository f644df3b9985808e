"""A nemo-serve subprocess for the benchmarks: a free port, readiness, a clean stop, and the
process readings (/proc) that the benchmarks take of it.

sweep.py's and frontend_bench.py's Servers build different command lines; what they share (start
with a log file, poll /readyz, SIGTERM then SIGKILL) lives here once, with the waits that differ
between them as class attributes a subclass sets.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """CPU seconds (utime + stime, all threads) of one live process."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / TICK


def children(pid: int) -> list[int]:
    """The direct children of `pid`."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        out.extend(int(c) for c in task.read_text().split())
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc/<pid>/task/*/children (recursively). With the
    multi-process server the top process is an idle supervisor: the engine core and the front
    ends are its children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children") if Path(f"/proc/{p}/task").exists() else ():
            try:
                todo.extend(int(c) for c in task.read_text().split())
            except OSError:
                pass
    return out


# ----------------------------------------------------------------------------- the server process


class ServerProcess:
    """nemo-serve in a subprocess with its stdout and stderr in a log file. A subclass builds the
    command and calls `_launch`; it sets `url` (`http://127.0.0.1:PORT`) before."""

    readyz_timeout_s = 5.0  # one /readyz request
    ready_poll_s = 0.5  # between /readyz tries while the server starts
    stop_grace_s = 30.0  # SIGTERM gets this long to drain before SIGKILL

    url: str
    command: list[str]

    def _launch(self, command: list[str], env: dict, log_path: Path, cwd: str | None = None) -> None:
        self.command = command
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def readyz(self) -> dict:
        with urllib.request.urlopen(self.url + "/readyz", timeout=self.readyz_timeout_s) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout_s: float = 600) -> dict:
        """/readyz's answer once it gives one; SystemExit when the server exits or `timeout_s` passes."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                return self.readyz()
            except OSError:
                time.sleep(self.ready_poll_s)
        raise SystemExit(f"server not ready after {timeout_s} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
