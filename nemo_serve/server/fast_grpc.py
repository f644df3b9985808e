"""The Riva gRPC service again on --fast-grpc-port: our own HTTP/2 (grpc_h2.py) on the front end's
event loop instead of grpc.aio, for less CPU per packet (benchmarks/grpc_layer_bench.py).

The service is riva_grpc.RivaSpeechRecognition itself, unchanged: each call's handler runs with a
CallContext that does for it what grpc.aio's ServicerContext does (read, write, abort, metadata,
peer), so StreamingRecognize, Recognize and GetRivaSpeechRecognitionConfig, the StreamSession, the
admission, token, limits (calls per address and in all), idle and duration clocks, slow readers
and the drain are the --grpc-port door's code. What grpc.aio did besides, done here:
  - a request message over --max-message-bytes: RESOURCE_EXHAUSTED from its 5-byte prefix, before
    any of it is buffered (grpc_stream.H2Stream.data);
  - grpc-timeout: the call is cancelled at its deadline, DEADLINE_EXCEEDED;
  - a client's RST_STREAM or a dropped connection cancels the call's handler (its `finally:`
    gives the slot back), as grpc.aio cancels it;
  - an unknown method: UNIMPLEMENTED; a handler's unexpected exception: INTERNAL, logged;
  - TLS with ALPN h2 (gRPC clients insist on it);
  - shutdown (runner.py, after the drain): stop accepting, GOAWAY, calls still running after the
    grace are cancelled and their connections dropped.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from .grpc_h2 import H2Connection
from .grpc_stream import H2Stream
from .riva_protos import request_parser

log = logging.getLogger("nemo_serve.riva")

SERVICE = "/nvidia.riva.asr.RivaSpeechRecognition/"
UNIMPLEMENTED, DEADLINE_EXCEEDED, INTERNAL = 12, 4, 13
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


class Aborted(Exception):
    """CallContext.abort: the handler's call ends with this status (grpc.aio's AbortError)."""


class CallContext:
    """What RivaSpeechRecognition asks of grpc.aio's ServicerContext, over one H2Stream."""

    def __init__(self, stream: H2Stream, parse) -> None:
        self.stream, self.parse = stream, parse
        self.status: tuple[int, str] | None = None  # set by abort

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [(k, v) for k, v in self.stream.headers if not k.startswith(":")]

    def peer(self) -> str:
        host, port = self.stream.conn.peer
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    async def read(self):
        """The next request, parsed (riva_protos.Malformed for bytes that are not one), or grpc.aio.EOF."""
        data = await self.stream.read()
        return grpc.aio.EOF if data is None else self.parse(data)

    def take_messages(self, handler) -> None:
        """riva_grpc's hook: from now on a request that finds the handler parked in `read` goes to
        `handler(request) -> bool` first, in the transport's callback (False: to `read` as before)."""
        parse = self.parse
        self.stream.take = lambda data: handler(parse(data))

    def write(self, response):
        return self.stream.send(response.SerializeToString())

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        self.status = (code.value[0], details)
        raise Aborted(details)


def riva_methods(ctx) -> dict:
    """The Riva service's methods: path -> (streaming, handler, request parser)."""
    from .riva_grpc import RivaSpeechRecognition
    from .riva_protos import load

    pb, _, audio_pb = load()
    servicer = RivaSpeechRecognition(ctx, pb, audio_pb)
    return {
        SERVICE + "StreamingRecognize": (True, servicer.StreamingRecognize, request_parser(pb.StreamingRecognizeRequest)),
        SERVICE + "Recognize": (False, servicer.Recognize, request_parser(pb.RecognizeRequest)),
        SERVICE + "GetRivaSpeechRecognitionConfig": (False, servicer.GetRivaSpeechRecognitionConfig,
                                                     request_parser(pb.RivaSpeechRecognitionConfigRequest)),
    }  # fmt: skip


class FastGrpcServer:
    """The listener of one front end: HTTP/2 connections, each call run as a task of its method's
    handler. `methods`: riva_methods(ctx) (tests and benchmarks give their own)."""

    def __init__(self, methods: dict, settings) -> None:
        self.settings, self.methods = settings, methods
        self.connections: set[H2Connection] = set()
        self.server: asyncio.AbstractServer | None = None

    # ------------------------------------------------------------------ what H2Connection calls
    def connection_made(self, conn: H2Connection) -> None:
        from .connections import bound_send_buffer

        self.connections.add(conn)
        bound_send_buffer(conn.transport)  # a client that stops reading is noticed soon (send timeout)

    def connection_lost(self, conn: H2Connection) -> None:
        self.connections.discard(conn)

    def start_call(self, stream: H2Stream) -> None:
        headers = dict(stream.headers)
        method = self.methods.get(headers.get(":path", ""))
        if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith("application/grpc"):
            stream.conn.finish(stream, UNIMPLEMENTED, "not a gRPC request")
            return
        if method is None:
            stream.conn.finish(stream, UNIMPLEMENTED, f"unknown method {headers.get(':path', '')[:100]}")
            return
        deadline_s = _timeout_s(headers.get("grpc-timeout"))
        stream.task = asyncio.get_running_loop().create_task(self._run(stream, *method, deadline_s))
        stream.task.add_done_callback(lambda _: _cancelled(stream))

    # ------------------------------------------------------------------ one call
    async def _run(self, stream: H2Stream, streaming: bool, handler, parse, deadline_s: float | None) -> None:
        context = CallContext(stream, parse)
        status: tuple[int, str] = (0, "")
        timer = None
        if deadline_s is not None:
            timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, stream)
        try:
            if streaming:
                await handler(None, context)
            else:
                request = await context.read()
                if request is grpc.aio.EOF:
                    raise Aborted("no request message")
                response = await handler(request, context)
                await stream.send(response.SerializeToString())
        except Aborted:
            status = context.status or (INTERNAL, "no request message")
        except asyncio.CancelledError:  # the client reset the stream or left; our refusal; the deadline
            status = stream.refusal or (grpc.StatusCode.CANCELLED.value[0], "call cancelled")
        except Exception:  # noqa: BLE001 - as grpc.aio: logged, the call ends INTERNAL
            log.exception("fast-grpc call failed in its handler")
            status = (INTERNAL, "internal server error")
        finally:
            if timer is not None:
                timer.cancel()
        stream.conn.finish(stream, *status)

    def _expire(self, stream: H2Stream) -> None:
        stream.refuse(DEADLINE_EXCEEDED, "Deadline Exceeded")

    # ------------------------------------------------------------------ listening
    async def start(self) -> None:
        """Listen on --fast-grpc-port, an SO_REUSEPORT socket as every front end's (the supervisor
        reserved the port)."""
        s = self.settings
        self.server = await asyncio.get_running_loop().create_server(
            lambda: H2Connection(self), s.host, s.fast_grpc_port, reuse_port=True, ssl=_ssl_context(s))

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; GOAWAY; after `grace_s` the calls still running are cancelled and their
        connections dropped (the drain ran before: only calls it gave up on remain)."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.goaway()
        tasks = [st.task for c in self.connections for st in c.streams.values() if st.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for conn in list(self.connections):
            conn.abort()


def _cancelled(stream: H2Stream) -> None:
    """A call cancelled before its handler ran (a refusal in the same read as its headers) never
    reached _run's own status: it is sent here (nothing, if the stream is closed already)."""
    stream.conn.finish(stream, *(stream.refusal or (grpc.StatusCode.CANCELLED.value[0], "call cancelled")))


def _timeout_s(value: str | None) -> float | None:
    """grpc-timeout ("10S", "1500m"): seconds, or None (none, or not in gRPC's form)."""
    if not value or value[-1] not in _TIMEOUT_UNITS or not value[:-1].isdigit() or len(value) > 9:
        return None
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


def _ssl_context(settings):
    if settings.ssl_certfile is None:
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(settings.ssl_certfile), str(settings.ssl_keyfile) if settings.ssl_keyfile else None)
    ctx.set_alpn_protocols(["h2"])
    return ctx
