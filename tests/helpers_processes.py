"""Which processes of a running server hold its listening and connected sockets, read from /proc
(test_multiprocess.py, test_admission.py)."""

from __future__ import annotations

import os
from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _socket_inodes(port: int, state: str) -> dict[int, int]:
    """inode -> remote port of TCP sockets on local `port` in `state` (0A listen, 01 established)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == state:
                found[int(f[9])] = int(f[2].rsplit(":", 1)[1], 16)
    return found


def _owners(pids: list[int], inodes) -> dict[int, int]:
    """pid -> how many of `inodes` it holds."""
    counts = {}
    for pid in pids:
        try:
            links = [os.readlink(p) for p in Path(f"/proc/{pid}/fd").iterdir()]
        except (FileNotFoundError, PermissionError):
            continue
        held = {int(x[8:-1]) for x in links if x.startswith("socket:[")}
        counts[pid] = len(held & set(inodes))
    return counts


def frontend_pids(srv) -> list[int]:
    listening = _socket_inodes(srv.port, "0A")
    return sorted(pid for pid, n in _owners(_children(srv.proc.pid), listening).items() if n)


def streams_per_frontend(srv) -> dict[int, int]:
    return _owners(frontend_pids(srv), _socket_inodes(srv.port, "01"))
