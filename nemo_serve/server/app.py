"""The FastAPI app: the streaming WebSocket, health, readiness, metrics and the browser page.

  WS  /ws (and /, for sherpa-onnx clients)  one stream per socket (session.py)
  GET /healthz   200 while the step loop is alive
  GET /readyz    200 with free and total slots; 503 when full, draining or the loop is dead
  GET /metrics   Prometheus text format
  GET /          the microphone page (static/)

Admission happens twice on purpose: a cheap check at the handshake answers HTTP 503 (or 401)
before the upgrade, so a full server costs a refused client one round trip; the slot itself
is taken when the first message arrives (it carries the language and endpoint options), and a
client that lost the race for the last slot gets an `error` message and close code 1013.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from pathlib import Path

from fastapi import FastAPI, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from .context import ServerContext
from .protocol import CLOSE_PROTOCOL_ERROR, CLOSE_TRY_AGAIN_LATER, ErrorMessage
from .session import Session

STATIC_DIR = Path(__file__).parent / "static"


def create_app(ctx: ServerContext) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if ctx.engine._thread is None:
            ctx.engine.start()
        watchdog = asyncio.create_task(ctx.watch_engine(), name="engine-watchdog")
        try:
            yield
        finally:
            watchdog.cancel()
            ctx.engine.stop()

    app = FastAPI(title="nemo-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

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
        body = {
            "ready": ctx.refusal() is None,
            "free_slots": engine.num_free_slots,
            "total_slots": engine.num_slots,
            "open_streams": engine.num_open_streams,
            "draining": ctx.draining,
            "model": ctx.model.name,
            "sample_rate": ctx.model.geometry.sample_rate,
            "chunk_ms": ctx.model.geometry.chunk_ms,
            "languages": sorted(ctx.model.prompt_dictionary) if ctx.model.prompt_dictionary else None,
            "auth": ctx.settings.auth_token is not None,
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    async def stream(ws: WebSocket) -> None:
        if not _authorized(ws, ctx.settings.auth_token):
            ctx.metrics.refusals.labels(reason="unauthorized").inc()
            await _refuse(ws, 401, "missing or wrong bearer token", CLOSE_PROTOCOL_ERROR)
            return
        refusal = ctx.refusal()
        if refusal is not None:
            label, reason = refusal
            ctx.metrics.refusals.labels(reason=label).inc()
            await _refuse(ws, 503, reason, CLOSE_TRY_AGAIN_LATER)
            return
        await ws.accept()
        await Session(ws, ctx).run()

    app.add_api_websocket_route("/ws", stream)
    app.add_api_websocket_route("/", stream)  # sherpa-onnx clients connect to the root
    return app


def _authorized(ws: WebSocket, token: str | None) -> bool:
    """`Authorization: Bearer TOKEN`, or `?token=TOKEN` for browsers (JavaScript cannot set
    WebSocket headers). Compared in constant time."""
    if token is None:
        return True
    header = ws.headers.get("authorization", "")
    given = header[7:].strip() if header[:7].lower() == "bearer " else ws.query_params.get("token", "")
    return hmac.compare_digest(given.encode(), token.encode())


async def _refuse(ws: WebSocket, status: int, reason: str, close_code: int) -> None:
    """HTTP status at the handshake; where the ASGI server cannot, an error message and a close."""
    body = ErrorMessage(reason=reason).model_dump()
    headers = {"Retry-After": "1"} if status == 503 else None
    try:
        await ws.send_denial_response(JSONResponse(body, status_code=status, headers=headers))
    except RuntimeError:
        await ws.accept()
        await ws.send_json(body)
        await ws.close(close_code, reason[:120])
