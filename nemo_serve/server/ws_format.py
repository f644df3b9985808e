"""/ws (and /, for sherpa-onnx's clients): nemo-serve's own wire format, on a StreamSession
(stream_session.py); its socket, receive and send tasks and close codes are ws_socket.py's.

  config (JSON, optional, first)  -> the stream's options; the URL's parameters are its defaults
  binary frame                    -> PCM decoded and resampled (audio.py), session.push
  end / "Done" / "eof"            -> end of input: the tail decoded, session.end_input
  force_final                     -> session.force_final (the segment closes at the audio so far)
  engine result                   -> partial / final (only what the client lacks: outbox.PartialTail),
                                     then done after the last one, then close 1000 (render)

Messages are protocol.py's. One engine stream per socket; the first message takes its slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

import msgspec
import numpy as np

from ..engine.endpoint import EndpointConfig
from ..engine.results import StreamResult
from .audio import AudioDecoder
from .context import ServerContext
from .outbox import PartialTail
from .protocol import (
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
    ReadyMessage,
    ResultMessage,
    SpeakerWordInfo,
    WordInfo,
    parse_client_text,
    parse_query_config,
    with_defaults,
)
from .stream_session import StreamSession
from .tokens import token_pieces
from .wire import Rendered


def _diarized(r: StreamResult, final: dict, token_offset: int) -> tuple[type, dict]:
    """A diarized stream's message class and its speaker fields (`final`'s words get theirs)."""
    if not r.is_final:
        return DiarizedResultMessage, {"speakers": r.token_speakers[token_offset:]}
    final["words"] = [SpeakerWordInfo(**w.model_dump(), speaker=k) for w, k in zip(final["words"], r.word_speakers or ())]
    return DiarizedFinalMessage, {"speakers": r.token_speakers[token_offset:], "speaker": r.speaker}


class WsFormat:
    """One /ws socket's messages over its StreamSession (owner: the event loop). ProtocolError or
    AudioError raised by on_text / on_bytes fail the stream (ws_socket.py)."""

    def __init__(self, ctx: ServerContext, name: str, log: logging.Logger, query: Mapping[str, str],
                 on_drop=None) -> None:  # fmt: skip
        """`query`: the URL's parameters, whose encoding and sample_rate are this stream's
        defaults; a bad one is refused before any frame is read (`config_error`)."""
        self.session = StreamSession(ctx, name, log, flush_input=self._flush, on_drop=on_drop)
        self.config = ConfigMessage(encoding=ctx.settings.default_encoding)  # until the client's config
        self.config_error: str | None = None
        try:
            self.config = parse_query_config(query, ctx.settings.default_encoding)
            ctx.model.geometry_for(self.config.context_right)  # a mode not served: refused before any audio
        except (ProtocolError, ValueError) as e:
            self.config_error = str(e)
        self.tail = PartialTail()  # what the client holds of the current segment
        self.reply_done_text = False  # the client ended with bare "Done"/"eof": send "Done!" (sherpa-onnx)
        self.decoder: AudioDecoder | None = None

    # ------------------------------------------------------------------ client frames
    def on_text(self, text: str) -> None:
        s = self.session
        msg = parse_client_text(text)
        if isinstance(msg, ConfigMessage):
            if s.stream is not None:
                raise ProtocolError("config must be the first message (it came after audio or another config)")
            self._open(with_defaults(msg, self.config))
        elif isinstance(msg, EndMessage):
            self.reply_done_text = isinstance(msg, BareEndMessage)
            if s.stream is None:
                self._open(self.config)
            if s.streaming:
                s.end_input("end")
            elif s.end_reason == "end":
                raise ProtocolError("end of input was already received")
        elif isinstance(msg, ForceFinalMessage):
            if s.stream is None:
                self._open(self.config)
            s.force_final()

    def on_bytes(self, data: bytes) -> None:
        s = self.session
        if s.stream is None:
            self._open(self.config)  # no config message: the URL's or the server's defaults
        if s.input_ended:
            if s.end_reason == "end":
                raise ProtocolError("audio after end of input")
            return  # the server ended input (drain, duration cap); the client may not know yet
        if not s.streaming:
            return
        s.push(self.decoder.decode(data))
        if self.decoder.input_seconds >= s.ctx.settings.max_stream_s:
            s.end_input("max_stream_duration")

    def _open(self, config: ConfigMessage) -> None:
        s, ctx = self.session, self.session.ctx
        self.config = config
        endpoint = self._endpoint(config)
        diarization = {"diarization": config.diarization.model_dump(exclude_none=True)} if config.diarization else {}
        if not s.open(config.context_right, interim_results=config.interim_results, language=config.language,
                      endpoint=endpoint, phrases=config.phrases, boost=config.boost, **diarization):  # fmt: skip
            return  # refused, or a bad config: the session is failing
        model, rate = ctx.model, ctx.model.geometry.sample_rate
        self.decoder = AudioDecoder(config.encoding, config.sample_rate or rate, rate)
        mode = model.geometry_for(config.context_right)
        s.queue(
            ReadyMessage(
                id=config.id,
                stream_id=s.stream.stream_id,
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

    def _flush(self) -> np.ndarray:
        """The decoder's tail at the end of input (the session's flush_input)."""
        return self.decoder.flush()

    # ------------------------------------------------------------------ what the send task writes
    def error_frame(self, reason: str, code: int) -> str:
        """The text frame sent before a failure's close (whatever its code)."""
        return ErrorMessage(id=self.config.id, reason=reason).model_dump_json()

    def render(self, r: StreamResult) -> Rendered:
        """Engine result `r`: its partial or final (none where the client asked for no partials),
        and after the last one `done` and close 1000."""
        frames = [self._result_message(r).model_dump_json()] if r.is_final or self.config.interim_results else []
        observed = bool(frames)
        if not r.done:
            return Rendered(frames, observed)
        return Rendered(frames + self._done_frames(r), observed, close="")

    def _done_frames(self, r: StreamResult) -> list[str]:
        """After the last result: "Done!" (the client ended with a bare "Done"/"eof"), then `done`."""
        done = DoneMessage(id=self.config.id, stream_id=r.stream_id, audio_processed=r.audio_processed_s,
                           reason=self.session.end_reason or "end")  # fmt: skip
        # sherpa-onnx's clients stop reading at "Done!" and print the message before it as the
        # result, so it comes after the last final and before `done` (rejected: "Done!" after
        # `done`, which those clients would print as the transcript).
        return [END_OF_INPUT_REPLY, done.model_dump_json()] if self.reply_done_text else [done.model_dump_json()]

    def _result_message(self, r: StreamResult):
        vocabulary = self.session.ctx.model.vocabulary
        token_offset, text_offset = self.tail.offsets(r)
        ids = r.token_ids[token_offset:]
        final = {"words": [WordInfo(**msgspec.structs.asdict(w)) for w in r.words or ()], "end_reason": r.end_reason,
                 "eou_probability": r.eou_probability, "eou_time": r.eou_time_s,
                 "backchannel": r.backchannel} if r.is_final else {}  # fmt: skip
        message_class, speaker_fields = (FinalMessage if r.is_final else ResultMessage), {}
        if r.token_speakers is not None:  # a diarized stream
            message_class, speaker_fields = _diarized(r, final, token_offset)
        return message_class(
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
            sent_time=time.time(),
            **final,
        )
