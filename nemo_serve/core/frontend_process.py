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
class Frontend:
    """A front end as build_frontend makes it: the app (sessions, metrics, drain) and its context, and
    the connection caps and header deadline, which the server that owns the sockets enforces."""

    app: object  # FastAPI
    ctx: object  # ServerContext
    limiter: object  # ConnectionLimiter: --max-connections, --max-connections-per-ip
    header_timeout_s: float


def build_frontend(settings, info, cores: list, frontend: int, *, drain_on_shutdown: bool = False,
                   on_shutdown=None) -> Frontend:  # fmt: skip
    """The one builder of a front end, for the front-end process and the Ray replica: the context
    over the engine cores, the app, the connection caps (lowered to what the open-file limit
    allows) and the token's redaction in the logs (the server that configures its own log handlers
    afterwards installs it again)."""
    import resource

    from ..compose import frontend_context
    from ..server import logsafe
    from ..server.app import create_app
    from ..server.connections import ConnectionLimiter, max_connections_for

    ctx = frontend_context(settings, info, cores, frontend)
    app = create_app(ctx, drain_on_shutdown=drain_on_shutdown, on_shutdown=on_shutdown)
    soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    max_total = max_connections_for(settings.max_connections, None if soft_limit == resource.RLIM_INFINITY else soft_limit)
    if max_total < settings.max_connections:
        log.warning("--max-connections %d lowered to %d: this process may open only %d files (ulimit -n)",
                    settings.max_connections, max_total, soft_limit)  # fmt: skip
    limiter = ConnectionLimiter(max_total, min(settings.max_connections_per_ip, max_total), ctx.metrics)
    logsafe.install(secrets=(settings.auth_token,) if settings.auth_token else ())
    return Frontend(app, ctx, limiter, settings.header_timeout_s)


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
    from ..server.runner import serve

    configure_logging(settings.log_level, nemo=False)
    k = num_frontends
    settings = settings.model_copy(update={
        "max_connections": max(1, -(-settings.max_connections // k)),
        "max_connections_per_ip": max(1, -(-settings.max_connections_per_ip // k)),
        # each front end refuses past its share before any audio; the core checks the whole
        "max_phrases_total": -(-settings.max_phrases_total // k),
    })  # fmt: skip
    built = build_frontend(settings, info, cores, frontend)
    sock = bind_reuseport(settings.host, port)
    log.debug("front end %d (pid %d) serving on port %d", frontend, os.getpid(), port)
    serve(built, settings, sock=sock)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
