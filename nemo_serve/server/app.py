"""The FastAPI app: the streaming WebSocket, health, readiness, metrics and the browser page.

  WS  /ws (and /, for sherpa-onnx clients)  one stream per socket (ws_socket.py, ws_format.py)
  WS  /v1/realtime  OpenAI Realtime transcription, GA and beta dialects (realtime.py)
  WS  /v1/listen    Deepgram's live streaming protocol (deepgram_live.py)
  POST /v1/audio/transcriptions  OpenAI's file transcription, through the engine (transcriptions.py)
  POST /v1/listen  Deepgram's pre-recorded transcription, on the same machinery (deepgram_prerecorded.py)
  POST /v1/realtime/transcription_sessions  NIM's session bootstrap before /v1/realtime (nim_sessions.py)
  GET /healthz   200 while an engine core serves
  GET /readyz    200 with free and total slots; 503 when full, draining or no engine core serves
  GET /metrics   Prometheus text format
  GET /          the browser page (static/)
  GET /samples/  the bundled utterances and their manifest, for the page's "Try a sample"

Before anything else, a browser's Origin must be the server's own page or in --allowed-origins
(403 otherwise): WebSockets are not covered by CORS, so without this check any web page could
drive a server that has no token. Clients that send no Origin header are not browsers and pass.

Admission happens twice on purpose: a cheap check at the handshake answers HTTP 503 (or 401)
before the upgrade, so a full server costs a refused client one round trip; the slot itself
is taken when the first message arrives (it carries the language and endpoint options), and a
client that lost the race for the last slot gets an `error` message and close code 1013.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import ipaddress
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from fastapi import FastAPI, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.requests import HTTPConnection

from . import deepgram_live
from .auth import accepted_subprotocol, authorized, realtime_authorized
from .context import Refused, ServerContext
from .deepgram_prerecorded import add_prerecorded_routes
from .logsafe import preview
from .protocol import CLOSE_PROTOCOL_ERROR, CLOSE_TRY_AGAIN_LATER, ErrorMessage, close_reason
from .nim_sessions import add_nim_session_routes
from .realtime import realtime_wire
from .ws_socket import WsSocket
from .transcriptions import add_transcription_routes

STATIC_DIR = Path(__file__).parent / "static"
SAMPLES_DIR = Path(__file__).parent.parent / "assets" / "demo" / "utterances"


def create_app(ctx: ServerContext, drain_on_shutdown: bool = False, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """`drain_on_shutdown`: the app's shutdown drains the open streams first (every one gets its
    final, within --drain-timeout-s): for hosts that stop the app themselves (a Ray Serve replica
    being scaled down); our own server drains on SIGTERM before the shutdown (runner.py).
    `on_shutdown`: called last, after the engine stopped (a replica stops its engine cores)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not ctx.engine.started:
            ctx.engine.start()
        watchdog = asyncio.create_task(ctx.watch_engine(), name="engine-watchdog")
        try:
            yield
        finally:
            if drain_on_shutdown and ctx.sessions:
                await ctx.drain()
            watchdog.cancel()
            ctx.engine.stop()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="nemo-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _add_sample_routes(app)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if not ctx.engine_alive:
            return JSONResponse({"status": "error", "reason": repr(ctx.engine.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        engine = ctx.engine
        now = time.time()  # one moment for the verdict and every core's cap (a cap grows with time)
        refusal, verdict = ctx.readiness(now)  # reads only: polling it changes no admission
        body = {
            "ready": refusal is None,
            "free_slots": engine.num_free_slots,
            "total_slots": engine.num_slots,
            "open_streams": engine.num_open_streams,
            "draining": ctx.draining,
            "queue_delay_s": round(engine.queue_delay_s, 3),
            "overloaded": verdict.overloaded,
            # most open streams admitted while recovering (several cores: the sum, a core without a cap
            # counting its slots; each core's under `cores`); null: the slots
            "recovering_cap": verdict.cap,
            "model": ctx.model.name,
            "sample_rate": ctx.model.geometry.sample_rate,
            "chunk_ms": ctx.model.geometry.chunk_ms,  # the default mode's
            "context_right": ctx.model.geometry.context_right,
            "modes": _modes(ctx),
            "languages": sorted(ctx.model.prompt_dictionary) if ctx.model.prompt_dictionary else None,
            "auth": ctx.settings.auth_token is not None,
            "pid": os.getpid(),  # the process that answered (one of the front ends)
            "cores": engine.cores(now),  # each engine core's numbers (one with one core)
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    allowed_origins = ctx.settings.origin_allow_list
    loopback_only = _is_loopback(ctx.settings.host)

    def handshake_refusal(conn: HTTPConnection) -> tuple[int, str, int] | None:
        """(HTTP status, reason, close code) for a stream's upgrade request that is refused, or
        None; counted in the refusal metric. Also the picows listener's check (picows_listener.py),
        which must answer the upgrade before the app runs."""
        bad_origin = _origin_refusal(conn, allowed_origins, loopback_only)
        if bad_origin is not None:
            ctx.metrics.refusals.labels(reason="origin").inc()
            return 403, bad_origin, CLOSE_PROTOCOL_ERROR
        # /v1/realtime also takes a client secret minted by POST /v1/realtime/transcription_sessions
        allowed = realtime_authorized if conn.scope["path"] == "/v1/realtime" else authorized
        if not allowed(conn, ctx.settings.auth_token):
            ctx.metrics.refusals.labels(reason="unauthorized").inc()
            return 401, "missing or wrong bearer token", CLOSE_PROTOCOL_ERROR
        if conn.scope["path"] == "/v1/listen":  # Deepgram answers a bad parameter 400, before any audio
            bad_query = deepgram_live.query_refusal(conn.query_params, ctx)
            if bad_query is not None:
                ctx.metrics.refusals.labels(reason="bad_request").inc()
                return 400, bad_query, CLOSE_PROTOCOL_ERROR
        try:
            ctx.admit()  # at the handshake: a full server answers 503; the slot is taken at the first message
        except Refused as e:
            return 503, e.reason, CLOSE_TRY_AGAIN_LATER
        return None

    app.state.handshake_refusal = handshake_refusal

    async def stream(ws: WebSocket) -> None:
        refusal = handshake_refusal(ws)
        if refusal is not None:
            await _refuse(ws, *refusal)
            return
        realtime = ws.scope["path"] == "/v1/realtime"
        if realtime:
            await ws.accept(subprotocol=accepted_subprotocol(ws))  # NIM's client offers `realtime`
            await WsSocket(ws, ctx, realtime_wire).run()
            return
        if ws.scope["path"] == "/v1/listen":
            await ws.accept()
            await WsSocket(ws, ctx, deepgram_live.deepgram_wire).run()
            return
        await ws.accept()
        await WsSocket(ws, ctx).run()

    app.add_api_websocket_route("/ws", stream)
    app.add_api_websocket_route("/", stream)  # sherpa-onnx clients connect to the root
    app.add_api_websocket_route("/v1/realtime", stream)  # OpenAI Realtime transcription (realtime.py)
    app.add_api_websocket_route("/v1/listen", stream)  # Deepgram's live protocol (deepgram_live.py)
    # A browser page may POST a multipart form cross-origin without a preflight: same Origin rule as the sockets
    add_transcription_routes(app, ctx, origin_refusal=lambda conn: _origin_refusal(conn, allowed_origins, loopback_only))
    add_prerecorded_routes(app, ctx, origin_refusal=lambda conn: _origin_refusal(conn, allowed_origins, loopback_only))
    add_nim_session_routes(app, ctx)
    return app


def _add_sample_routes(app: FastAPI) -> None:
    """The bundled utterances (16 kHz WAVs and manifest.jsonl) as static files: the page streams
    them at real-time pace. Public like the page: they ship with the package."""
    if SAMPLES_DIR.is_dir():
        app.mount("/samples", StaticFiles(directory=SAMPLES_DIR), name="samples")


def _origin_refusal(ws: HTTPConnection, allowed: frozenset[str], loopback_only: bool) -> str | None:
    """Why this handshake's Origin is refused, or None. Same-origin means the Origin's host and
    port are the Host the client asked for; on a server bound to loopback that Host must also
    be a loopback name, or a page on an attacker's domain re-pointed at 127.0.0.1 (DNS
    rebinding) would count as same-origin."""
    origin = ws.headers.get("origin")
    if origin is None:
        return None
    normal = origin.strip().lower().rstrip("/")
    if "*" in allowed or normal in allowed:
        return None
    host = ws.headers.get("host", "").lower()
    if _same_origin(normal, host) and (not loopback_only or _is_loopback(urlsplit("//" + host).hostname or "")):
        return None
    return f"origin {preview(origin, 80)} is not allowed (--allowed-origins)"


def _same_origin(origin: str, host: str) -> bool:
    try:
        o, h = urlsplit(origin), urlsplit("//" + host)
        default = {"http": 80, "https": 443}.get(o.scheme)
        return default is not None and o.hostname == h.hostname and (o.port or default) == (h.port or default)
    except ValueError:  # a port that is not a number
        return False


def _modes(ctx) -> list[dict]:
    """Every served chunk mode with the streams open in it (the first is the default)."""
    open_by_mode = ctx.engine.open_by_mode()
    return [
        {"context_right": r, "chunk_ms": g.chunk_ms, "open_streams": open_by_mode.get(r, 0)}
        for r, g in (ctx.model.geometries or {ctx.model.geometry.context_right: ctx.model.geometry}).items()
    ]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _refuse(ws: WebSocket, status: int, reason: str, close_code: int) -> None:
    """HTTP status at the handshake; where the ASGI server cannot, an error message and a close."""
    body = ErrorMessage(reason=reason).model_dump()
    headers = {"Retry-After": "1"} if status == 503 else None
    try:
        await ws.send_denial_response(JSONResponse(body, status_code=status, headers=headers))
    except RuntimeError:
        await ws.accept()
        await ws.send_json(body)
        await ws.close(close_code, close_reason(reason))
