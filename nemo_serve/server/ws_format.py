"""/ws (and /, for sherpa-onnx's clients): nemo-serve's own wire format, on session.py's Session.

  config (JSON, optional, first)  -> the stream's options; the URL's parameters are its defaults
  binary frame                    -> PCM decoded and resampled (audio.py), engine.push
  end / "Done" / "eof"            -> end of input: the tail decoded, engine.finish
  force_final                     -> engine.force_final (the segment closes at the audio so far)
  engine result                   -> partial / final (only what the client lacks: outbox.PartialTail),
                                     then done and close 1000 after the last one

Messages are protocol.py's. One engine stream per socket; the first message takes its slot.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

import msgspec

from ..engine.endpoint import EndpointConfig
from ..engine.results import StreamResult
from .audio import AudioDecoder
from .outbox import PartialTail
from .protocol import (
    CLOSE_NORMAL,
    END_OF_INPUT_REPLY,
    BareEndMessage,
    ConfigMessage,
    DiarizedFinalMessage,
    DiarizedResultMessage,
    DoneMessage,
    EndMessage,
    ErrorMessage,
    FinalMessage,
    ForceFinalMessage,
    ProtocolError,
    ProtocolState,
    ReadyMessage,
    ResultMessage,
    SpeakerWordInfo,
    WordInfo,
    parse_client_text,
    parse_query_config,
    with_defaults,
)
from .session import Session
from .tokens import token_pieces


def _diarized(r: StreamResult, final: dict, token_offset: int) -> tuple[type, dict]:
    """A diarized stream's message class and its speaker fields (`final`'s words get theirs)."""
    if not r.is_final:
        return DiarizedResultMessage, {"speakers": r.token_speakers[token_offset:]}
    final["words"] = [SpeakerWordInfo(**w.model_dump(), speaker=k) for w, k in zip(final["words"], r.word_speakers or ())]
    return DiarizedFinalMessage, {"speakers": r.token_speakers[token_offset:], "speaker": r.speaker}


class WsFormat:
    """One /ws socket's messages and its one engine stream (owner: the event loop)."""

    def __init__(self, session: Session, query: Mapping[str, str]) -> None:
        """`query`: the URL's parameters, whose encoding and sample_rate are this stream's
        defaults; a bad one is refused before any frame is read."""
        self.session = session
        ctx = session.ctx
        self.config = ConfigMessage(encoding=ctx.settings.default_encoding)  # until the client's config
        self.config_error: str | None = None
        try:
            self.config = parse_query_config(query, ctx.settings.default_encoding)
            ctx.model.geometry_for(self.config.context_right)  # a mode not served: refused before any audio
        except (ProtocolError, ValueError) as e:
            self.config_error = str(e)
        self.tail = PartialTail()  # what the client holds of the current segment
        self.reply_done_text = False  # the client ended with bare "Done"/"eof": send "Done!" (sherpa-onnx)
        self.stream = None  # the engine's handle (has .stream_id) once admitted
        self.decoder: AudioDecoder | None = None
        self._audio_processed_s = 0.0

    # ------------------------------------------------------------------ client frames
    def on_text(self, text: str) -> None:
        s = self.session
        msg = parse_client_text(text)
        if isinstance(msg, ConfigMessage):
            if s.state is not ProtocolState.CONNECTED:
                raise ProtocolError("config must be the first message (it came after audio or another config)")
            self._open(with_defaults(msg, self.config))
        elif isinstance(msg, EndMessage):
            self.reply_done_text = isinstance(msg, BareEndMessage)
            if s.state is ProtocolState.CONNECTED:
                self._open(self.config)
            if s.state is ProtocolState.STREAMING:
                s.end_input("end")
            elif s.end_reason == "end":
                raise ProtocolError("end of input was already received")
        elif isinstance(msg, ForceFinalMessage):
            if s.state is ProtocolState.CONNECTED:
                self._open(self.config)
            if s.state is ProtocolState.STREAMING:
                s.ctx.engine.force_final(self.stream)

    def on_bytes(self, data: bytes) -> None:
        s = self.session
        if s.state is ProtocolState.CONNECTED:
            self._open(self.config)  # no config message: the URL's or the server's defaults
        if s.state is ProtocolState.ENDING:
            if s.end_reason == "end":
                raise ProtocolError("audio after end of input")
            return  # the server ended input (drain, duration cap); the client may not know yet
        if s.state is not ProtocolState.STREAMING:
            return
        samples = self.decoder.decode(data)
        if len(samples):
            s.ctx.engine.push(self.stream, samples)
        if self.decoder.input_seconds >= s.ctx.settings.max_stream_s:
            s.end_input("max_stream_duration")

    def _open(self, config: ConfigMessage) -> None:
        s, ctx = self.session, self.session.ctx
        self.config = config
        self.stream = s.open(
            config.context_right, s.engine_callback(self._take_result), language=config.language,
            endpoint=self._endpoint(config), phrases=config.phrases, boost=config.boost,
            **({"diarization": config.diarization.model_dump(exclude_none=True)} if config.diarization else {}),
        )  # fmt: skip
        if s.state is not ProtocolState.STREAMING:
            return  # refused, or a bad config: the session is failing
        model, rate = ctx.model, ctx.model.geometry.sample_rate
        self.decoder = AudioDecoder(config.encoding, config.sample_rate or rate, rate)
        mode = model.geometry_for(config.context_right)
        s.outbox.put(
            ReadyMessage(
                id=config.id,
                stream_id=self.stream.stream_id,
                chunk_ms=mode.chunk_ms,
                context_right=mode.context_right,
                sample_rate=rate,
                input_sample_rate=self.decoder.input_rate,
                encoding=config.encoding,
                interim_results=config.interim_results,
                language=config.language or model.default_language,
                max_message_bytes=ctx.settings.max_message_bytes,
            )
        )

    def _endpoint(self, config: ConfigMessage) -> EndpointConfig:
        base = self.session.ctx.settings.endpoint_config
        if config.endpointing is None:
            return base
        override = {k: v for k, v in config.endpointing.model_dump().items() if v is not None}
        return replace(base, **override).validated()

    # ------------------------------------------------------------------ lifecycle hooks
    def end_input(self) -> None:
        tail = self.decoder.flush()
        if len(tail):
            self.session.ctx.engine.push(self.stream, tail)
        self.session.ctx.engine.finish(self.stream)

    def abort(self, reason: str) -> None:
        if self.stream is not None:
            self.session.ctx.engine.abort(self.stream, reason)  # idempotent; a no-op once the stream is done

    def behind_s(self) -> float:
        return self.decoder.input_seconds - self._audio_processed_s

    def reading_resumed(self) -> None:
        pass

    def receive_timeout(self, timeout_s: float | None) -> float | None:
        return timeout_s

    def on_timeout(self, now: float) -> bool:
        return False

    # ------------------------------------------------------------------ results
    def _take_result(self, r: StreamResult) -> None:
        """On the event loop: count the model's progress, then queue what is sent."""
        self.session.consumed(r.audio_processed_s - self._audio_processed_s)
        self._audio_processed_s = max(self._audio_processed_s, r.audio_processed_s)
        if r.is_final or r.done or self.config.interim_results:
            self.session.queue(r)

    def error_frame(self, reason: str, code: int) -> str:
        return ErrorMessage(id=self.config.id, reason=reason).model_dump_json()

    async def send_result(self, r: StreamResult) -> bool:
        """Send one engine result (and `done` after the last one); True when the socket is closed."""
        s = self.session
        if r.is_final or self.config.interim_results:
            m, vocabulary = s.ctx.metrics, s.ctx.model.vocabulary
            token_offset, text_offset = self.tail.offsets(r)
            ids = r.token_ids[token_offset:]
            sent = time.time()
            final = {"words": [WordInfo(**msgspec.structs.asdict(w)) for w in r.words or ()], "end_reason": r.end_reason,
                     "eou_probability": r.eou_probability, "eou_time": r.eou_time_s,
                     "backchannel": r.backchannel} if r.is_final else {}  # fmt: skip
            message_class, speaker_fields = (FinalMessage if r.is_final else ResultMessage), {}
            if r.token_speakers is not None:  # a diarized stream
                message_class, speaker_fields = _diarized(r, final, token_offset)
            await s.send(
                message_class(
                    **speaker_fields,
                    type="final" if r.is_final else "partial",
                    id=self.config.id,
                    stream_id=r.stream_id,
                    segment=r.segment,
                    is_final=r.is_final,
                    text=r.text[text_offset:],
                    tokens=token_pieces(vocabulary, ids),
                    token_ids=ids,
                    timestamps=r.token_times_s[token_offset:],
                    token_offset=token_offset,
                    text_offset=text_offset,
                    start_time=r.segment_start_s,
                    audio_processed=r.audio_processed_s,
                    audio_arrival_time=r.audio_arrival_time,
                    sent_time=sent,
                    **final,
                )
            )
            m.result_sent(r.is_final, s.mode_label, max(0.0, sent - r.audio_arrival_time))
        if not r.done:
            return False
        if self.reply_done_text:
            # sherpa-onnx's clients stop reading at "Done!" and print the message before it as
            # the result, so it comes after the last final and before `done` (rejected: "Done!"
            # after `done`, which those clients would print as the transcript).
            await s.send_text(END_OF_INPUT_REPLY)
        await s.send(
            DoneMessage(id=self.config.id, stream_id=r.stream_id, audio_processed=r.audio_processed_s,
                        reason=s.end_reason or "end")  # fmt: skip
        )
        await s.close_socket(CLOSE_NORMAL)
        return True
