"""Riva ASR over gRPC (`--grpc-port`): NVIDIA's RivaSpeechRecognition service on this server's engine.

A grpc.aio server on the front end's own event loop, beside uvicorn (runner.py starts and stops
it), so each call is a session of the same ServerContext as /ws: one admission check, the same
slots, limits, metrics and drain. Riva's wire format lives in riva_mapping.py; here is the call's
lifecycle.

  StreamingRecognize  receive task: streaming_config -> admission -> audio_content -> push ...
                      -> end of the client's stream: finish (the tail rule, as /ws's end)
                      the handler: results -> StreamingRecognizeResponse, one write at a time,
                      each within --send-timeout-s; returns after the last final
  Recognize           the whole audio pushed at once, decoded as fast as the model allows; one
                      SpeechRecognitionResult per segment the endpointer closed
  GetRivaSpeechRecognitionConfig  the model, its served modes (as model names) and languages

A call's admission, failure and engine results follow lifecycle.py, as a WebSocket session's do;
its ending item is a gRPC status instead of an error frame and a close.

Errors end only their call: a bad request with INVALID_ARGUMENT, a refusal with
RESOURCE_EXHAUSTED (no free slot, overloaded) or UNAVAILABLE (draining, engine failed), a missing
or wrong token with UNAUTHENTICATED, each with the same reason /ws gives.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time

import grpc

from ..engine.results import StreamResult
from .audio import AudioDecoder, AudioError
from .connections import ConnectionLimiter
from .context import Refused, ServerContext
from .lifecycle import StreamLifecycle
from .protocol import CLOSE_GOING_AWAY, CLOSE_PROTOCOL_ERROR, CLOSE_SERVER_ERROR, CLOSE_TRY_AGAIN_LATER
from .riva_mapping import (
    LeadingWav,
    RivaConfig,
    RivaRequestError,
    mode_model_name,
    offline_result,
    parse_config,
    streaming_result,
)
from .riva_protos import Malformed
from .session import MAX_AHEAD_S

log = logging.getLogger("nemo_serve.riva")
_numbers = itertools.count(1)

# The reasons ServerContext gives (drain, engine watchdog) carry WebSocket close codes.
_STATUS_FOR_CLOSE = {
    CLOSE_PROTOCOL_ERROR: grpc.StatusCode.INVALID_ARGUMENT,
    CLOSE_TRY_AGAIN_LATER: grpc.StatusCode.UNAVAILABLE,
    CLOSE_GOING_AWAY: grpc.StatusCode.UNAVAILABLE,
    CLOSE_SERVER_ERROR: grpc.StatusCode.INTERNAL,
}
_STATUS_FOR_REFUSAL = {"no_free_slot": grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED}


class _Failure:
    def __init__(self, status: grpc.StatusCode, reason: str) -> None:
        self.status, self.reason = status, reason


class RivaCall(StreamLifecycle):
    """One Recognize or StreamingRecognize call, as ServerContext sees a session (drain, fail,
    drop). Owner: the event loop."""

    def __init__(self, ctx: ServerContext, context: grpc.aio.ServicerContext) -> None:
        number = next(_numbers)
        super().__init__(ctx, f"riva{number}", log)  # outbox: StreamResult | _Failure; partials coalesce
        self.context = context
        self.number = number
        self.config: RivaConfig | None = None
        self.stream = None  # the engine's handle once admitted
        self.wav = LeadingWav()
        self.decoder: AudioDecoder | None = None  # made when the input rate is known (WAV header)
        self.input_ended = False
        self._task = asyncio.current_task()
        self._audio_processed_s = 0.0

    # ------------------------------------------------------------------ session interface
    def drain(self) -> None:
        """Server shutdown: end input so the final comes out; not admitted yet: refuse."""
        if self.stream is None:
            self.fail("server is draining (shutting down)", CLOSE_TRY_AGAIN_LATER, "draining")
        elif not self.input_ended:
            try:
                self.end_input()
            except (RivaRequestError, AudioError) as e:  # the audio ended inside its WAV header
                self.fail(str(e), grpc.StatusCode.INVALID_ARGUMENT, "bad_audio")

    def abort_streams(self, reason: str) -> None:
        if self.stream is not None:
            self.ctx.engine.abort(self.stream, reason)  # idempotent; a no-op once the stream is done

    def ending_item(self, reason: str, code) -> _Failure:
        """The call's status: `code` is a grpc.StatusCode or a WebSocket close code."""
        status = code if isinstance(code, grpc.StatusCode) else _STATUS_FOR_CLOSE.get(code, grpc.StatusCode.INTERNAL)
        return _Failure(status, reason)

    def drop(self) -> None:
        """The drain's last resort: a client that does not take its status. Cancel the handler."""
        self.abort_streams("connection dropped")
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ input
    def open(self, config: RivaConfig) -> bool:
        """Take a slot, or fail the call with the refusal; the only place a call is admitted."""
        self.config = config
        try:
            self.stream = self.admit(self.engine_callback(self._take_result), config.context_right,
                                     language=config.language, endpoint=config.endpoint, phrases=config.phrases,
                                     boost=config.boost)  # fmt: skip
        except Refused as e:
            self.fail(e.reason, _STATUS_FOR_REFUSAL.get(e.label, grpc.StatusCode.UNAVAILABLE), "refused")
            return False
        except ValueError as e:  # parse_config checked language and mode: these are the phrases
            self.fail(f"speech_contexts: {e}" if config.phrases else str(e), grpc.StatusCode.INVALID_ARGUMENT,
                      "bad_config")  # fmt: skip
            return False
        return True

    def push(self, data: bytes) -> None:
        """Audio bytes (a WAV header at the start is read, not decoded) -> the engine."""
        if self.input_ended or self.closing:
            return
        pcm = self.wav.feed(data)
        if pcm:
            self._push_pcm(pcm)

    def _push_pcm(self, pcm: bytes) -> None:
        if self.decoder is None:
            rate = self.ctx.model.geometry.sample_rate
            header_rate = self.wav.sample_rate  # range-checked by LeadingWav, as the config's by parse_config
            if self.config.sample_rate and header_rate and header_rate != self.config.sample_rate:
                raise RivaRequestError(
                    f"sample_rate_hertz {self.config.sample_rate} but the WAV header says {header_rate}"
                )
            self.decoder = AudioDecoder("pcm_s16le", self.config.sample_rate or header_rate or rate, rate)
        # --max-stream-s from the declared rate and the byte count, before decoding: bytes past
        # the cap are never decoded or resampled (Recognize's 1 MiB is 65 s at 8 kHz).
        room_samples = int(self.ctx.settings.max_stream_s * self.decoder.input_rate) - self.decoder.num_input_samples
        room_bytes = 2 * max(0, room_samples)
        capped = len(pcm) >= room_bytes
        samples = self.decoder.decode(pcm[:room_bytes] if capped else pcm)
        if len(samples):
            self.ctx.engine.push(self.stream, samples)
        if capped:
            self.end_input()

    def end_input(self) -> None:
        if self.input_ended or self.closing:
            return
        tail = self.wav.flush()
        if tail:
            self._push_pcm(tail)
        if self.decoder is not None:
            rest = self.decoder.flush()
            if len(rest):
                self.ctx.engine.push(self.stream, rest)
        self.input_ended = True
        self.ctx.engine.finish(self.stream)
        self._progress.set()

    async def wait_for_model(self) -> None:
        """Stop reading while the model is more than MAX_AHEAD_S behind this call's input (HTTP/2
        flow control then slows the client), as /ws does."""
        while (
            not self.closing and not self.input_ended and self.decoder is not None
            and self.decoder.input_seconds - self._audio_processed_s > MAX_AHEAD_S
        ):  # fmt: skip
            self._progress.clear()
            await self._progress.wait()

    def seconds_left(self) -> float:
        """Until --max-stream-s of wall time since admission (the audio cap is in _push_pcm)."""
        return max(0.0, self.opened_at + self.ctx.settings.max_stream_s - time.monotonic())

    # ------------------------------------------------------------------ results
    def _take_result(self, r: StreamResult) -> None:
        """An engine result on the event loop (lifecycle.py has dropped it after a failure, and
        failed the call on an engine error)."""
        self.ctx.metrics.audio_seconds.inc(max(0.0, r.audio_processed_s - self._audio_processed_s))
        self._audio_processed_s = max(self._audio_processed_s, r.audio_processed_s)
        self._progress.set()
        if not (r.is_final or r.done or self.config.interim_results):
            return
        if not self.outbox.put(r):
            self.fail(f"client is not reading results ({len(self.outbox)} waiting)", reason_label="slow_client")

    async def results(self):
        """The results to send, until the last one; a failure ends the call with its status."""
        while True:
            item = await self.outbox.get()
            if isinstance(item, _Failure):
                await self.context.abort(item.status, item.reason)
            yield item
            if item.done:
                return

    def sent(self, r: StreamResult) -> None:
        self.ctx.metrics.result_sent(r.is_final, self.mode_label, max(0.0, time.time() - r.audio_arrival_time))

    def close(self) -> None:
        """The handler's `finally:` whatever ended the call: the slot comes back, metrics settle."""
        self.abort_streams("call ended")
        self.settle()
        self.stream = None
        self.closing = True


class RivaSpeechRecognition:
    """The servicer: one RivaCall per call. `pb`: riva_asr_pb2, `audio_pb`: riva_audio_pb2."""

    def __init__(self, ctx: ServerContext, pb, audio_pb) -> None:
        self.ctx, self.pb = ctx, pb
        self.encodings = audio_pb.AudioEncoding
        # Calls, not TCP connections (HTTP/2 carries many calls on one): --max-connections and
        # --max-connections-per-ip bound them as they bound /ws's sockets, counted apart from those.
        self.calls = ConnectionLimiter(ctx.settings.max_connections, ctx.settings.max_connections_per_ip)

    async def _count_in(self, call: "RivaCall", context) -> None:
        reason = self.calls.acquire(call, _peer_address(context.peer()))
        if reason is not None:
            self.ctx.metrics.refusals.labels(reason="connection_limit").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)

    async def _authorize(self, context, request=None) -> None:
        """The token (if the server has one), then a unary call's request bytes (see Malformed)."""
        token = self.ctx.settings.auth_token
        header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if token is not None and not hmac.compare_digest(given.encode(), token.encode()):
            self.ctx.metrics.refusals.labels(reason="unauthorized").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (metadata 'authorization')")
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

    def _config(self, config, interim: bool) -> RivaConfig:
        return parse_config(config, self.ctx.model, self.ctx.settings.endpoint_config, interim, self.encodings)

    # ------------------------------------------------------------------ StreamingRecognize
    async def StreamingRecognize(self, request_iterator, context):  # noqa: N802 - the proto's name
        await self._authorize(context)
        call = RivaCall(self.ctx, context)
        await self._count_in(call, context)
        self.ctx.add(call)
        receive = asyncio.create_task(self._receive(call, context), name=f"riva{call.number}-receive")
        try:
            async for r in call.results():
                if (r.is_final and r.text) or (not r.is_final and call.config.interim_results):
                    result = streaming_result(self.pb, r, call.config.word_time_offsets)
                    try:
                        await asyncio.wait_for(
                            context.write(self.pb.StreamingRecognizeResponse(results=[result])),
                            self.ctx.settings.send_timeout_s,
                        )
                    except asyncio.TimeoutError:
                        timeout_s = self.ctx.settings.send_timeout_s
                        call.fail(f"client is not reading results (none written for {timeout_s:g} s)",
                                  reason_label="slow_client")  # fmt: skip
                        continue
                    call.sent(r)
        finally:
            receive.cancel()
            await asyncio.gather(receive, return_exceptions=True)
            call.close()
            self.ctx.remove(call)
            self.calls.release(call)

    async def _receive(self, call: RivaCall, context) -> None:
        try:
            first = await self._read(call, context)
            if first is None:
                raise RivaRequestError("the stream ended before its streaming_config")
            if not first.HasField("streaming_config"):
                raise RivaRequestError("the first message must carry streaming_config (then audio_content)")
            sc = first.streaming_config
            if not call.open(self._config(sc.config, sc.interim_results)):
                return
            while not call.closing and not call.input_ended:
                request = await self._read(call, context)
                if request is None:
                    call.end_input()
                    return
                if request.HasField("streaming_config"):
                    raise RivaRequestError("streaming_config may come only in the first message")
                call.push(request.audio_content)
                await call.wait_for_model()
        except (RivaRequestError, AudioError) as e:
            call.fail(str(e), grpc.StatusCode.INVALID_ARGUMENT, "bad_audio" if isinstance(e, AudioError) else "protocol")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the client's stream broke (cancelled, reset): end the call
            log.debug("riva%d receive ended: %r", call.number, e)
            call.fail("request stream failed", grpc.StatusCode.CANCELLED, "client_gone")

    async def _read(self, call: RivaCall, context):
        """The next request, or None at the end of the client's stream. Idle and duration limits
        as /ws: no message for --idle-timeout-s fails the call; --max-stream-s ends its input."""
        settings = self.ctx.settings
        timeout_s = settings.idle_timeout_s if call.stream is None else min(settings.idle_timeout_s, call.seconds_left())
        try:
            request = await asyncio.wait_for(context.read(), timeout_s)
        except asyncio.TimeoutError:
            if call.stream is not None and call.seconds_left() <= 0:
                call.end_input()
                return None
            call.fail(f"idle timeout: no message for {settings.idle_timeout_s:g} s", reason_label="idle_timeout")
            return None
        if isinstance(request, Malformed):
            raise RivaRequestError(request.reason)
        return None if request is grpc.aio.EOF else request

    # ------------------------------------------------------------------ Recognize
    async def Recognize(self, request, context):  # noqa: N802
        await self._authorize(context, request)
        call = RivaCall(self.ctx, context)
        await self._count_in(call, context)
        self.ctx.add(call)
        config = None
        try:
            try:
                config = self._config(request.config, False)
                # The whole audio is here: its WAV header (format, channels, rate) is checked
                # before a slot is taken, so a refused call never holds one.
                pcm = call.wav.feed(request.audio) + call.wav.flush()
                if call.open(config):
                    call.push(pcm)
                    call.end_input()
            except (RivaRequestError, AudioError) as e:
                call.fail(str(e), grpc.StatusCode.INVALID_ARGUMENT, "bad_audio" if isinstance(e, AudioError) else "protocol")
            results = []
            async for r in call.results():
                if r.is_final and r.text:
                    results.append(offline_result(self.pb, r, config.word_time_offsets))
                    call.sent(r)
            return self.pb.RecognizeResponse(results=results)
        finally:
            call.close()
            self.ctx.remove(call)
            self.calls.release(call)

    # ------------------------------------------------------------------ GetRivaSpeechRecognitionConfig
    async def GetRivaSpeechRecognitionConfig(self, request, context):  # noqa: N802
        await self._authorize(context, request)
        model = self.ctx.model
        languages = ",".join(sorted(model.prompt_dictionary)) if model.prompt_dictionary else (model.default_language or "")
        configs = []
        for i, r in enumerate(model.modes):
            name = model.name if i == 0 else mode_model_name(model, r)
            if request.model_name and request.model_name not in (name, mode_model_name(model, r)):
                continue
            g = model.geometry_for(r)
            configs.append(self.pb.RivaSpeechRecognitionConfigResponse.Config(model_name=name, parameters={
                "type": "online", "streaming": "true", "offline": "true", "language_code": languages,
                "sample_rate": str(g.sample_rate), "chunk_size": f"{g.chunk_ms / 1000:g}",
                "context_right": str(r), "default": "true" if i == 0 else "false",
                "mode_model_name": mode_model_name(model, r),
            }))  # fmt: skip
        return self.pb.RivaSpeechRecognitionConfigResponse(model_config=configs)


def _peer_address(peer: str) -> str:
    """grpc's peer, "ipv4:1.2.3.4:5678" or "ipv6:[::1]:5678", without scheme and port."""
    scheme, _, rest = peer.partition(":")
    return rest.rsplit(":", 1)[0].strip("[]") if scheme in ("ipv4", "ipv6") else peer


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_riva_server(ctx: ServerContext):
    """Build, bind and start the gRPC server on the running loop; the caller stops it."""
    from .riva_protos import add_servicer, load

    pb, _, audio_pb = load()
    s = ctx.settings
    options = [
        ("grpc.so_reuseport", 1),  # every front end listens on the port the supervisor reserved
        ("grpc.max_receive_message_length", s.max_message_bytes),  # one audio message, or Recognize's whole audio
    ]
    if s.ping_interval_s:
        options += [("grpc.keepalive_time_ms", int(s.ping_interval_s * 1000)),
                    ("grpc.keepalive_timeout_ms", int(s.ping_timeout_s * 1000))]  # fmt: skip
    server = grpc.aio.server(options=options)  # calls are counted per address by the servicer
    add_servicer(server, RivaSpeechRecognition(ctx, pb, audio_pb), pb)
    address = grpc_address(s.host, s.grpc_port)
    if s.tls:
        key = (s.ssl_keyfile or s.ssl_certfile).read_bytes()
        server.add_secure_port(address, grpc.ssl_server_credentials([(key, s.ssl_certfile.read_bytes())]))
    else:
        server.add_insecure_port(address)
    await server.start()
    return server
