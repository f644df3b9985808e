"""A front-end process: the FastAPI app and sessions, with an EngineGroup for the engine cores.

Every front end binds the same port with SO_REUSEPORT; the kernel spreads new connections
over them. A front end holds no model and imports no torch: it decodes audio, writes it into
the slot rings, assembles results from the core's updates and speaks the protocols.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass

from ..console import configure_logging
from .shared import SharedLayout

log = logging.getLogger("nemo_serve.frontend")


def bind_reuseport(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(addr)
    return sock


@dataclass(frozen=True)
class CoreEndpoint:
    """How a front end reaches one engine core: its shared memory, slot lock and sockets' directory."""

    index: int
    device: str
    shm_name: str
    layout: SharedLayout
    lock: object  # shared.FileLock
    ipc_dir: str
    pid: int


def run_frontend_process(settings, info, cores: list[CoreEndpoint], frontend: int, port: int, num_frontends: int) -> None:
    """Process entry (spawned by the supervisor). The connection caps are per process, so each
    front end enforces its share of --max-connections and --max-connections-per-ip (the kernel
    spreads connections evenly over the front ends' sockets)."""
    from ..compose import frontend_context
    from ..server.app import create_app
    from ..server.runner import serve

    configure_logging(settings.log_level, nemo=False)
    k = num_frontends
    settings = settings.model_copy(update={
        "max_connections": max(1, -(-settings.max_connections // k)),
        "max_connections_per_ip": max(1, -(-settings.max_connections_per_ip // k)),
        # each front end refuses past its share before any audio; the core checks the whole
        "max_phrases_total": -(-settings.max_phrases_total // k),
    })  # fmt: skip
    ctx = frontend_context(settings, info, cores, frontend)
    sock = bind_reuseport(settings.host, port)
    log.debug("front end %d (pid %d) serving on port %d", frontend, os.getpid(), port)
    serve(create_app(ctx), ctx, settings, sock=sock)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
