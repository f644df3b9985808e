"""What a nemo-serve process says on its terminal: the log set-up and the line of URLs. Used by the
CLI and by the processes the supervisor spawns (core/), which must not import the CLI.
"""

from __future__ import annotations

import logging

from .config import Settings


def print_urls(s: Settings, port: int | None = None) -> None:
    """The one line an operator needs: where the page, the stream, the metrics and readiness are."""
    host = "localhost" if s.host in ("127.0.0.1", "0.0.0.0", "::") else s.host
    port = s.port if port is None else port
    http, ws = ("https", "wss") if s.tls else ("http", "ws")
    print(
        f"page {http}://{host}:{port}/  stream {ws}://{host}:{port}/ws  "
        f"metrics {http}://{host}:{port}/metrics  ready {http}://{host}:{port}/readyz",
        flush=True,
    )
    if s.grpc_port is not None:
        print(f"riva gRPC {host}:{s.grpc_port}{' (TLS)' if s.tls else ''}", flush=True)
    if s.fast_grpc_port is not None:
        print(f"riva gRPC (fast) {host}:{s.fast_grpc_port}{' (TLS)' if s.tls else ''}", flush=True)
    if not s.tls and s.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            "note: without --ssl-certfile, browsers allow the microphone only on localhost pages",
            flush=True,
        )


def configure_logging(level: str, nemo: bool = True) -> None:
    """Our loggers at the chosen level; everyone else's (NeMo's telemetry, lightning, ...) only
    from WARNING: at start-up an operator needs the summary line, not import chatter. `nemo`:
    this process loads NeMo (the engine core, --selftest), whose own logger is quieted here; it
    takes importing NeMo and torch, which the supervisor and the front ends never need."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nemo_serve").setLevel(level.upper())
    logging.getLogger("nv_one_logger").setLevel(logging.ERROR)  # NeMo's telemetry: "no exporters"
    if nemo and level != "debug":
        try:
            from nemo.utils import logging as nemo_logging

            nemo_logging.setLevel(logging.WARNING)
        except Exception:  # noqa: BLE001 - logging cosmetics must never stop the server
            pass
