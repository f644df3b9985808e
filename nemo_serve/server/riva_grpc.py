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

A call is a StreamSession (stream_session.py): admission, the idle and duration clocks,
backpressure, the send deadline, the result intake and the failure live there; here are Riva's
audio and the mapping of a Failure to a gRPC status (grpc_status).

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

import numpy as np

from .audio import AudioDecoder, AudioError
from .connections import ConnectionLimiter
from .context import ServerContext
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
from .stream_session import Failure, StreamSession

log = logging.getLogger("nemo_serve.riva")
_numbers = itertools.count(1)

# A failure's gRPC status by its label (stream_session.Failure); the rest: INVALID_ARGUMENT.
_STATUS_FOR_LABEL = {
    "draining": grpc.StatusCode.UNAVAILABLE,
    "drain_timeout": grpc.StatusCode.UNAVAILABLE,
    "engine": grpc.StatusCode.INTERNAL,
    "internal": grpc.StatusCode.INTERNAL,
    "client_gone": grpc.StatusCode.CANCELLED,
}
# A refusal's: a full or overloaded server is out of resources; a draining or failed one unavailable.
_STATUS_FOR_REFUSAL = {"no_free_slot": grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED}


def grpc_status(f: Failure) -> grpc.StatusCode:
    if f.label == "refused":
        return _STATUS_FOR_REFUSAL.get(f.refusal, grpc.StatusCode.UNAVAILABLE)
    return _STATUS_FOR_LABEL.get(f.label, grpc.StatusCode.INVALID_ARGUMENT)


class RivaCall:
    """One Recognize or StreamingRecognize call: Riva's audio (a WAV header, 16-bit PCM at the
    config's rate) into a StreamSession, whose lifecycle it is. Owner: the event loop."""

    def __init__(self, ctx: ServerContext, context: grpc.aio.ServicerContext) -> None:
        self.number = next(_numbers)
        self.ctx, self.context = ctx, context
        self.session = StreamSession(ctx, f"riva{self.number}", log, flush_input=self._flush, on_drop=self._cancel)
        self.config: RivaConfig | None = None
        self.wav = LeadingWav()
        self.decoder: AudioDecoder | None = None  # made when the input rate is known (WAV header)
        self._task = asyncio.current_task()
        self.clock = InputClock(self.session)

    def _cancel(self) -> None:
        """The drain's last resort: a client that does not take its status. Cancel the handler."""
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ input
    def open(self, config: RivaConfig) -> bool:
        """Take a slot, or fail the call with the refusal; the only place a call is admitted."""
        self.config = config
        # parse_config checked language and mode: an option error here is about the phrases
        return self.session.open(config.context_right, interim_results=config.interim_results,
                                 config_prefix="speech_contexts: " if config.phrases else "", language=config.language,
                                 endpoint=config.endpoint, phrases=config.phrases, boost=config.boost,
                                 diarization=config.diarization)  # fmt: skip

    def push(self, data: bytes) -> None:
        """Audio bytes (a WAV header at the start is read, not decoded) -> the engine."""
        if not self.session.streaming:
            return
        pcm = self.wav.feed(data)
        if pcm:
            samples, capped = self._decode(pcm)
            self.session.push(samples)
            if capped:
                self.session.end_input("max_stream_duration")

    def _decode(self, pcm: bytes) -> tuple[np.ndarray, bool]:
        """Model-rate samples, and whether --max-stream-s of audio is reached."""
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
        return self.decoder.decode(pcm[:room_bytes] if capped else pcm), capped

    def _flush(self) -> np.ndarray:
        """The input's tail at its end (the session's flush_input): RivaRequestError when the
        audio ended inside its WAV header."""
        tail = self.wav.flush()
        parts = [self._decode(tail)[0]] if tail else []
        if self.decoder is not None:
            parts.append(self.decoder.flush())
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    # ------------------------------------------------------------------ results
    async def results(self):
        """The results to send, until the last one; a failure ends the call with its status."""
        while True:
            item = await self.session.next_event()
            if isinstance(item, Failure):
                await self.context.abort(grpc_status(item), item.reason)
            yield item
            if item.done:
                return

    def close(self) -> None:
        """The handler's `finally:` whatever ended the call: the slot comes back, metrics settle."""
        self.clock.stop()
        self.session.close("call ended")


class InputClock:
    """The session's idle and duration clocks (StreamSession.input_deadline) over a call's reads,
    as one timer per call that is moved only when it rings: StreamSession.receive's
    asyncio.wait_for per read made a task and a timer per audio message (12 us of a 20 ms packet's
    CPU here; benchmarks/packet_cost.py). When the deadline has passed while a read waits, the read
    is cancelled, as wait_for cancelled it, and `read` returns None after the session acted on it."""

    def __init__(self, session: StreamSession) -> None:
        self.session = session
        self._timer: asyncio.TimerHandle | None = None
        self._reader: asyncio.Task | None = None  # the task inside read(), while it waits
        self._rang = False

    async def read(self, read):
        """The client's next message, or None when a clock ran out (as StreamSession.receive)."""
        if self._timer is None and not self._arm():
            return await read()  # input ended: no clock runs
        self._reader = asyncio.current_task()
        try:
            message = await read()
        except asyncio.CancelledError:
            if not self._rang:
                raise
            # A message that arrived in the same instant is lost, as with wait_for: the deadline
            # ends the input (or the call) either way.
            self._rang = False
            asyncio.current_task().uncancel()
            self.session.input_deadline_passed()
            return None
        finally:
            self._reader = None
        self.session.last_input = time.monotonic()
        return message

    def _arm(self) -> bool:
        deadline = self.session.input_deadline()
        if deadline is None:
            return False
        self._timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._ring)
        return True

    def _ring(self) -> None:
        self._timer = None
        deadline = self.session.input_deadline()
        if deadline is None:
            return
        if self._reader is None or time.monotonic() < deadline:  # moved on meanwhile: the new deadline
            self._arm()
            return
        self._rang = True
        self._reader.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


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
        self.ctx.add(call.session)
        receive = asyncio.create_task(self._receive(call, context), name=f"riva{call.number}-receive")
        try:
            async for r in call.results():
                if (r.is_final and r.text) or (not r.is_final and call.config.interim_results):
                    result = streaming_result(self.pb, r, call.config.word_time_offsets)
                    if await call.session.send(context.write(self.pb.StreamingRecognizeResponse(results=[result]))):
                        call.session.result_sent(r)
        finally:
            receive.cancel()
            await asyncio.gather(receive, return_exceptions=True)
            call.close()
            self.ctx.remove(call.session)
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
            # --fast-grpc-port's hook (fast_grpc.CallContext; grpc.aio's context has none): audio
            # that finds this task parked in its read is handled in the transport's callback, as
            # --fast-ws-port's take_frames does: no task wake-up per packet.
            take_messages = getattr(context, "take_messages", None)
            if take_messages is not None:
                take_messages(lambda request: self._take(call, request))
            while call.session.streaming:
                request = await self._read(call, context)
                if request is None:
                    call.session.end_input()
                    return
                if request.HasField("streaming_config"):
                    raise RivaRequestError("streaming_config may come only in the first message")
                call.push(request.audio_content)
                await call.session.wait_for_model()
        except (RivaRequestError, AudioError) as e:
            call.session.fail(str(e), "bad_audio" if isinstance(e, AudioError) else "protocol")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the client's stream broke (cancelled, reset): end the call
            log.debug("riva%d receive ended: %r", call.number, e)
            call.session.fail("request stream failed", "client_gone")

    def _take(self, call: RivaCall, request) -> bool:
        """An audio message handled now (True), or left to the receive task (False): anything but
        audio while streaming with the model keeping up, so every error and the backpressure wait
        stay the task's, in order."""
        if (not call.session.streaming or call.session.model_behind() or isinstance(request, Malformed)
                or request.HasField("streaming_config")):  # fmt: skip
            return False
        call.session.last_input = time.monotonic()
        try:
            call.push(request.audio_content)
        except (RivaRequestError, AudioError) as e:
            call.session.fail(str(e), "bad_audio" if isinstance(e, AudioError) else "protocol")
        return True

    async def _read(self, call: RivaCall, context):
        """The next request, or None at the end of the client's stream or when the session's
        idle or duration clock ran out (stream_session.StreamSession.receive)."""
        request = await call.clock.read(context.read)
        if isinstance(request, Malformed):
            raise RivaRequestError(request.reason)
        return None if request is grpc.aio.EOF else request

    # ------------------------------------------------------------------ Recognize
    async def Recognize(self, request, context):  # noqa: N802
        await self._authorize(context, request)
        call = RivaCall(self.ctx, context)
        await self._count_in(call, context)
        self.ctx.add(call.session)
        config = None
        try:
            try:
                config = self._config(request.config, False)
                # The whole audio is here: its WAV header (format, channels, rate) is checked
                # before a slot is taken, so a refused call never holds one.
                pcm = call.wav.feed(request.audio) + call.wav.flush()
                if call.open(config):
                    call.push(pcm)
                    call.session.end_input()
            except (RivaRequestError, AudioError) as e:
                call.session.fail(str(e), "bad_audio" if isinstance(e, AudioError) else "protocol")
            results = []
            async for r in call.results():
                if r.is_final and r.text:
                    results.append(offline_result(self.pb, r, config.word_time_offsets))
                    call.session.result_sent(r)
            return self.pb.RecognizeResponse(results=results)
        finally:
            call.close()
            self.ctx.remove(call.session)
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
