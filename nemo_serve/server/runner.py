"""Run a front end's app under uvicorn, with a graceful drain on SIGTERM.

uvicorn's own shutdown closes every open WebSocket at once with code 1012, which would throw
away the final result of every stream in flight. So the first SIGTERM (the supervisor passes on
its own SIGTERM or Ctrl-C) starts our drain instead (stop admitting, end each stream's input,
wait for the finals, bounded by --drain-timeout-s) and only then lets uvicorn shut down. A
second SIGTERM falls through to uvicorn: immediate shutdown.

With --grpc-port, the Riva gRPC server (riva_grpc.py) runs on the same event loop: started
after the app's lifespan (the engine is up), drained with the WebSocket streams (its calls are
sessions of the same context), stopped before the lifespan ends; --fast-grpc-port's
(fast_grpc.py) likewise.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from ..collector import tune_collector_for_serving
from ..config import Settings
from . import heap_trim, logsafe
from .connections import ConnectionLimits
from .context import ServerContext
from .uvicorn_protocols import protocol_classes

log = logging.getLogger("nemo_serve.server")

RIVA_STOP_GRACE_S = 1.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._grpc = None  # grpc.aio.Server with --grpc-port
        self.fast_ws = None  # picows_listener.FastWsListener with --fast-ws-port (set by serve())
        self._fast_grpc = None  # fast_grpc.FastGrpcServer with --fast-grpc-port
        self.heap_trim_period_s = 0.0  # --heap-trim-period-s (set by serve()); 0: no trim task
        self._heap_trim_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.ctx.settings.grpc_port is not None and not self.should_exit:
            from .riva_grpc import start_riva_server

            try:
                self._grpc = await start_riva_server(self.ctx)
            except Exception as e:  # noqa: BLE001 - a port in use, a bad certificate: one line, then exit
                # as uvicorn does when its own port is taken: the app shuts down, status 3
                log.error("Riva gRPC server on port %s failed to start: %s", self.ctx.settings.grpc_port, e)
                for server in self.servers:
                    server.close()
                await self.lifespan.shutdown()
                sys.exit(STARTUP_FAILURE)
        if self.ctx.settings.fast_grpc_port is not None and not self.should_exit:
            from .fast_grpc import FastGrpcServer, riva_methods

            self._fast_grpc = FastGrpcServer(riva_methods(self.ctx), self.ctx.settings)
            await self._fast_grpc.start()  # a port in use fails the start-up, as --port's would
        if self.fast_ws is not None and not self.should_exit:
            await self.fast_ws.start()  # a port in use fails the start-up, as --port's would
        # Every listener up, the lifespan run: what exists now lives as long as the process. Ours
        # alone: the Ray replica (build_frontend too) runs in Ray's worker, whose heap is Ray's.
        tune_collector_for_serving()
        if self.heap_trim_period_s > 0:
            self._heap_trim_task = asyncio.ensure_future(heap_trim.trim_periodically(self.heap_trim_period_s))

    async def shutdown(self, sockets=None) -> None:
        if self._heap_trim_task is not None:
            self._heap_trim_task.cancel()
        if self._grpc is not None:
            await self._grpc.stop(RIVA_STOP_GRACE_S)  # after the drain: only calls it gave up on remain
        if self._fast_grpc is not None:
            await self._fast_grpc.stop(RIVA_STOP_GRACE_S)  # after the drain, as --grpc-port's
        if self.fast_ws is not None:
            await self.fast_ws.close()  # after the drain, as gRPC
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # A front end's supervisor turns Ctrl-C into one SIGTERM (the terminal sends SIGINT to the
        # whole process group: counting it too would make the first Ctrl-C a "second signal" and
        # skip the drain).
        if sig == signal.SIGINT:
            return
        if self._drain_task is None and self._loop is not None and self.started and not self.should_exit:
            log.info("received %s: draining (send it again to quit at once)", signal.Signals(sig).name)
            # A signal handler interrupts the loop mid-callback: schedule, do not run, the drain.
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.ctx.drain()
        finally:
            self.should_exit = True


def serve(frontend, settings: Settings, sock: socket.socket) -> None:
    """Serve a front end (core/frontend_process.build_frontend: app, context, connection caps) on
    `sock`, its bound SO_REUSEPORT socket (the supervisor owns --host/--port)."""
    app, ctx = frontend.app, frontend.ctx
    http_protocol, ws_protocol = protocol_classes(ConnectionLimits(frontend.limiter, frontend.header_timeout_s))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=http_protocol,  # httptools, with the caps and the header deadline (connections.py)
        ws=ws_protocol,  # websockets-sansio, likewise
        ws_max_size=settings.max_message_bytes,  # the transport refuses bigger frames with 1009
        ws_ping_interval=settings.ping_interval_s or None,
        ws_ping_timeout=settings.ping_timeout_s,
        ws_per_message_deflate=False,  # PCM barely compresses; deflate costs CPU per frame
        ssl_certfile=str(settings.ssl_certfile) if settings.ssl_certfile else None,
        ssl_keyfile=str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    # After uvicorn.Config, which has just (re)configured uvicorn's handlers.
    logsafe.install(secrets=(settings.auth_token,) if settings.auth_token else ())
    server = DrainingServer(config, ctx)
    server.heap_trim_period_s = settings.heap_trim_period_s
    if settings.fast_ws_port is not None:
        from .picows_listener import FastWsListener

        server.fast_ws = FastWsListener(app, ConnectionLimits(frontend.limiter, frontend.header_timeout_s), settings)
    server.run(sockets=[sock])
