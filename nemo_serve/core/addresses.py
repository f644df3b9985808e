"""Where the engine core and the front ends meet: the ZMQ socket addresses in the server's
private directory (the supervisor's temporary `ipc_dir`). Both sides import this, neither the other.
"""

from __future__ import annotations

from pathlib import Path


def control_address(ipc_dir: str) -> str:
    """The core's PULL socket: control messages from every front end and the supervisor."""
    return f"ipc://{Path(ipc_dir) / 'core.ctl'}"


def results_address(ipc_dir: str, frontend: int) -> str:
    """One front end's PULL socket: the core's Results for its streams."""
    return f"ipc://{Path(ipc_dir) / f'frontend{frontend}.results'}"
