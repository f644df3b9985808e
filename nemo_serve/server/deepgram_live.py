"""/v1/listen: Deepgram's live streaming protocol (what deepgram-sdk's listen.v1 socket client,
so pipecat's DeepgramSTTService, and livekit-plugins-deepgram speak), as a wire format over a
StreamSession; the socket, its tasks and close codes are ws_socket.py's, as for /ws.

  URL query (DeepgramOptions)  checked at the handshake (app.handshake_refusal): a bad value is
                               HTTP 400 with the reason, before any slot or audio work;
                               keywords / keyterm: the stream's phrase boosting (deepgram_keywords.py)
  first frame but CloseStream  -> session.open (the slot: a Deepgram connection is its stream)
  binary frame                 -> linear16 decoded and resampled (audio.py), session.push
  {"type": "KeepAlive"}        -> nothing (the frame itself moved the idle clock)
  {"type": "Finalize"}         -> session.force_final after the whole chunks sent before it: that
                                  final is sent with from_finalize true; where nothing was said
                                  since the last final, an empty one (Deepgram answers each)
  {"type": "CloseStream"}, or an empty binary frame (Deepgram's legacy close)
                               -> session.end_input: the remaining finals, Metadata, close 1000
  {"type": "Configure"}        -> ConfigureFailure (no mid-stream keyterms or features here)
  anything else                -> ProtocolError: an Error message, close 1008
  engine partial               -> Results is_final false (interim_results=true only)
  engine final                 -> Results is_final true; speech_final true where it has text and
                                  ended at an endpoint or the end of input; UtteranceEnd after an
                                  endpoint's final with words (utterance_end_ms given)
  first tokens of a segment    -> SpeechStarted at the first token's time (vad_events=true)

Results tile the stream's audio as Deepgram's do: each covers [start, start + duration) from the
end of the last is_final one to the audio the model consumed; its transcript is the segment's
text so far (the engine's segments are Deepgram's is_final windows). Tokens are /ws's: the same
decoder, push, finish and force_final. docs/deepgram.md says what is mapped and what is not.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import numpy as np

from ..engine.endpoint import EndpointConfig
from ..engine.results import StreamResult
from .audio import AudioDecoder
from .context import ServerContext
from .deepgram_keywords import keyword_phrases
from .protocol import CLOSE_PROTOCOL_ERROR, ProtocolError
from .stream_session import StreamSession
from .wire import NormalClose, Rendered

CHANNEL = [0, 1]  # channel_index of every message: channel 0 of 1 (mono only)
ENCODINGS = {"linear16": "pcm_s16le"}  # Deepgram's name -> audio.py's decoder
_BOOLEANS = {"true": True, "false": False}
# Query parameters that only switch a Deepgram feature on or off: checked as booleans, then
# ignored (the model's own casing and punctuation stand: docs/deepgram.md).
_IGNORED_BOOLEANS = ("punctuate", "smart_format", "profanity_filter", "numerals", "filler_words", "no_delay",
                     "diarize", "dictation", "mip_opt_out", "detect_entities", "multichannel")  # fmt: skip
# Finals whose segment ended where the speaker stopped (Deepgram's speech_final); not "max_length"
# (the 20 s rule) or "force_final" (the client's Finalize, from_finalize instead).
_SPEECH_ENDS = ("silence", "eou", "eob", "end_of_input")
_ENDPOINT_ENDS = ("silence", "eou", "eob")  # the ones an UtteranceEnd follows


def _package_version() -> str:
    try:
        return importlib.metadata.version("nemo-serve")
    except importlib.metadata.PackageNotFoundError:  # a source checkout that is not installed
        return "unknown"


SERVER_VERSION = _package_version()  # model_info.version: the server's (the model has none of its own)


@dataclass(frozen=True)
class DeepgramOptions:
    """The URL's parameters this server acts on (the rest is accepted and ignored)."""

    sample_rate: int = 16000
    interim_results: bool = False  # Deepgram's default
    endpointing_ms: int | None = None  # None: the server's rules; 0: endpointing=false
    utterance_end_ms: int | None = None
    vad_events: bool = False


def parse_options(query: Mapping[str, str]) -> DeepgramOptions:
    """The URL's options; ProtocolError says what is wrong with the first bad one."""
    encoding = query.get("encoding")
    if encoding is None:
        raise ProtocolError("encoding is required: linear16 (containers such as WAV are not decoded on /v1/listen)")
    if encoding.lower() not in ENCODINGS:
        raise ProtocolError(f"encoding {encoding[:40]!r} is not supported (supported: linear16)")
    rate = query.get("sample_rate")
    if rate is None:
        raise ProtocolError("sample_rate is required with encoding")
    channels = query.get("channels", "1")
    if channels != "1":
        raise ProtocolError(f"channels={channels[:20]!r}: only one channel (mono) is served")
    for name in _IGNORED_BOOLEANS:
        _boolean(query, name, False)
    if _boolean(query, "multichannel", False):
        raise ProtocolError("multichannel=true: only one channel (mono) is served")
    endpointing = query.get("endpointing")
    return DeepgramOptions(
        sample_rate=_integer("sample_rate", rate, 8000, 192000),
        interim_results=_boolean(query, "interim_results", False),
        endpointing_ms=None if endpointing is None or endpointing.lower() == "true" else (
            0 if endpointing.lower() == "false" else _integer("endpointing", endpointing, 0, 3_600_000)),  # fmt: skip
        utterance_end_ms=None if "utterance_end_ms" not in query else _integer(
            "utterance_end_ms", query["utterance_end_ms"], 1, 3_600_000),  # fmt: skip
        vad_events=_boolean(query, "vad_events", False),
    )


def _boolean(query: Mapping[str, str], name: str, default: bool) -> bool:
    text = query.get(name)
    if text is None:
        return default
    value = _BOOLEANS.get(text.lower())  # the SDK sends Python's True/False, livekit true/false
    if value is None:
        raise ProtocolError(f"{name}={text[:20]!r}: expected true or false")
    return value


def _integer(name: str, text: str, low: int, high: int) -> int:
    if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
        raise ProtocolError(f"{name}={text[:20]!r}: expected an integer in [{low}, {high}]")
    return int(text)


def endpoint_config(base: EndpointConfig, options: DeepgramOptions) -> EndpointConfig:
    """The stream's endpoint rules. endpointing=N ms raises rule 2's trailing silence to N where N
    is longer; shorter values (Deepgram's default is 10 ms) keep the server's: the engine's
    silence is encoder frames without a token, which also occur between words, so a 10 ms rule
    would end a segment at nearly every word (rejected). endpointing=false: rules 1 and 2 and
    EOU endings off; rule 3 (the segment's length) stays, so is_final still comes."""
    ms = options.endpointing_ms
    if ms is None or not base.enabled:
        return base
    if ms == 0:
        return replace(base, rule1_min_trailing_silence_s=3600.0, rule2_min_trailing_silence_s=3600.0, eou=False)
    s = ms / 1000
    return replace(base, rule1_min_trailing_silence_s=max(base.rule1_min_trailing_silence_s, s),
                   rule2_min_trailing_silence_s=max(base.rule2_min_trailing_silence_s, s))  # fmt: skip


def query_refusal(query, ctx: ServerContext) -> str | None:
    """Why the handshake's URL is refused (HTTP 400), or None."""
    try:
        parse_options(query)
        stream_phrases(query, ctx)
    except ProtocolError as e:
        return str(e)
    return None


def stream_phrases(query, ctx: ServerContext) -> dict:
    """`keywords` and `keyterm` as the stream's phrase boosting (deepgram_keywords.py): the
    phrases and boost to open the stream with ({}: none); ProtocolError for a bad one."""
    model = ctx.model
    try:
        boosting = keyword_phrases(query, ctx.settings.phrase_limits, model.vocabulary, model.is_bpe)
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    return {"phrases": list(boosting.phrases), "boost": boosting.boost} if boosting else {}


def deepgram_wire(ws, ctx: ServerContext, name: str, log: logging.Logger, on_drop) -> "DeepgramFormat":
    """ws_socket.WsSocket's wire factory for /v1/listen."""
    return DeepgramFormat(ctx, name, log, ws.query_params, on_drop=on_drop)


class _Frame:
    """An adapter message for the outbox: the send task writes model_dump_json() (ws_socket.py)."""

    def __init__(self, message: dict) -> None:
        self.text = json.dumps(message)

    def model_dump_json(self) -> str:
        return self.text


class DeepgramFormat:
    """One /v1/listen socket's messages over its StreamSession (owner: the event loop)."""

    def __init__(self, ctx: ServerContext, name: str, log: logging.Logger, query: Mapping[str, str],
                 on_drop=None) -> None:  # fmt: skip
        self.session = StreamSession(ctx, name, log, flush_input=self._flush, on_drop=on_drop)
        self.config_error: str | None = None
        self.phrases: dict = {}
        try:
            self.options = parse_options(query)
            self.phrases = stream_phrases(query, ctx)
        except ProtocolError as e:  # refused at the handshake already on our listeners
            self.options, self.config_error = DeepgramOptions(), str(e)
        self.request_id = str(uuid.uuid4())
        self.created = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        self.model_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, "nemo-serve:" + ctx.model.name))
        self.model_info = {"name": ctx.model.name, "version": SERVER_VERSION, "arch": "nemo-serve"}
        self.decoder: AudioDecoder | None = None
        self.audio_hash = hashlib.sha256()  # Metadata's sha256: of the audio bytes received
        self.num_samples = 0  # model-rate samples pushed (where a Finalize closes the segment)
        self.cursor_s = 0.0  # where the last is_final Results ended (the next one starts there)
        # Where each Finalize not yet answered ends its segment (audio_processed_s of the step that
        # reaches it). Deepgram answers every Finalize: with the forced final, or, where the engine
        # publishes none (nothing said since the last final), an empty one once a later step shows
        # the point passed.
        self.finalize_at_s: deque[float] = deque()
        self.started_segment = -1  # the segment SpeechStarted was sent for
        self.closed_input = False  # CloseStream (or the empty frame) came

    # ------------------------------------------------------------------ client frames
    def on_text(self, text: str) -> None:
        kind = _message_type(text)
        s = self.session
        if kind == "CloseStream":
            self._close_stream()
        elif kind == "KeepAlive":
            self._open_once()  # a Deepgram connection holds its stream from the start
        elif kind == "Finalize":
            self._open_once()
            if s.streaming:
                # Positional: the final holds every whole chunk of the audio sent before the
                # Finalize, however far the model has got (a plain force_final closed the segment
                # at what the model had decoded: an empty final, the audio in the next one). The
                # part chunk after them cannot be decoded while the stream goes on: next segment.
                self.finalize_at_s.append(s.ctx.model.whole_chunks_s(None, self.num_samples))
                s.interim_results = True  # every step's progress, to see a point passed with no final
                s.force_final(at_sample=self.num_samples)
        elif kind == "Configure":
            s.queue(_Frame({"type": "ConfigureFailure", "request_id": self.request_id,
                            "code": "CONFIGURE_KEYTERMS_NOT_SUPPORTED",
                            "description": "Configure is not supported by this server"}))  # fmt: skip
        else:
            raise ProtocolError(f"unknown message type {kind[:40]!r} (expected KeepAlive, Finalize or CloseStream)")

    def on_bytes(self, data: bytes) -> None:
        if not data:
            self._close_stream()  # Deepgram's legacy close: an empty binary frame
            return
        s = self.session
        self._open_once()
        if s.input_ended:
            if self.closed_input:
                raise ProtocolError("audio after CloseStream")
            return  # the server ended input (drain, duration cap); the client may not know yet
        if not s.streaming:
            return
        self.audio_hash.update(data)
        samples = self.decoder.decode(data)
        s.push(samples)
        self.num_samples += len(samples)
        if self.decoder.input_seconds >= s.ctx.settings.max_stream_s:
            s.end_input("max_stream_duration")

    def _open_once(self) -> None:
        s = self.session
        if s.stream is not None or s.closing:
            return
        options, ctx = self.options, s.ctx
        # Partials also when only SpeechStarted needs them (render drops them then).
        if not s.open(interim_results=options.interim_results or options.vad_events,
                      endpoint=endpoint_config(ctx.settings.endpoint_config, options).validated(), **self.phrases):  # fmt: skip
            return  # refused: the session is failing
        self.decoder = AudioDecoder(ENCODINGS["linear16"], options.sample_rate, ctx.model.geometry.sample_rate)

    def _close_stream(self) -> None:
        s = self.session
        if self.closed_input:
            return  # Deepgram takes a repeated CloseStream quietly
        self.closed_input = True
        if s.stream is None and not s.closing:  # nothing was sent: no stream to end
            s.queue(_Frame(self._metadata()))
            s.queue(NormalClose(""))
        elif s.streaming:
            s.end_input("end")

    def _flush(self) -> np.ndarray:
        return self.decoder.flush()

    # ------------------------------------------------------------------ what the send task writes
    def error_frame(self, reason: str, code: int) -> str:
        variant = "DataError" if code == CLOSE_PROTOCOL_ERROR else "ServerError"
        return json.dumps({"type": "Error", "variant": variant, "description": reason, "message": reason})

    def render(self, r: StreamResult) -> Rendered:
        """Engine result `r`: SpeechStarted (first tokens, vad_events), Results, UtteranceEnd
        (after an endpoint's final, utterance_end_ms); after the last one Metadata and close 1000."""
        frames = self._finalize_answers(r)
        if self.options.vad_events and r.token_ids and r.segment != self.started_segment:
            self.started_segment = r.segment
            frames.append(json.dumps({"type": "SpeechStarted", "channel": CHANNEL, "timestamp": r.token_times_s[0]}))
        observed = r.is_final or self.options.interim_results
        if observed:
            from_finalize = r.is_final and r.end_reason == "force_final" and bool(self.finalize_at_s)
            if from_finalize:
                self._answered()
            frames.append(json.dumps(self._results(r, from_finalize)))
        if r.is_final and r.words and self.options.utterance_end_ms is not None and r.end_reason in _ENDPOINT_ENDS:
            frames.append(json.dumps({"type": "UtteranceEnd", "channel": CHANNEL, "last_word_end": r.words[-1].end}))
        if not r.done:
            return Rendered(frames, observed)
        return Rendered(frames + [json.dumps(self._metadata())], observed, close="")

    def _finalize_answers(self, r: StreamResult) -> list[str]:
        """Empty from_finalize finals for the Finalize points that a later step passed with no
        forced final (strictly later: the step that reaches a point publishes its update before
        the forced final), and for all left at the stream's end. Their window is empty: the
        segment's text so far belongs to the next final."""
        frames = []
        while self.finalize_at_s and (r.done or (r.end_reason != "force_final"
                                                 and r.audio_processed_s > self.finalize_at_s[0] + 1e-6)):  # fmt: skip
            self._answered()
            frames.append(json.dumps(self._message(self.cursor_s, self.cursor_s, True, False, True, "", [])))
        return frames

    def _answered(self) -> None:
        self.finalize_at_s.popleft()
        if not self.finalize_at_s:
            self.session.interim_results = self.options.interim_results or self.options.vad_events

    def _results(self, r: StreamResult, from_finalize: bool) -> dict:
        start = self.cursor_s
        end = max(start, r.audio_processed_s)
        if r.is_final:
            self.cursor_s = end
        words = [{"word": w.word, "start": w.start, "end": w.end, "confidence": 1.0 if w.confidence is None else w.confidence,
                  "punctuated_word": w.word} for w in r.words or ()]  # fmt: skip
        speech_final = r.is_final and r.end_reason in _SPEECH_ENDS and bool(r.text.strip())  # no speech, no end of it
        return self._message(start, end, r.is_final, speech_final, from_finalize, r.text, words)

    def _message(self, start: float, end: float, is_final: bool, speech_final: bool, from_finalize: bool,
                 transcript: str, words: list[dict]) -> dict:  # fmt: skip
        confidence = min((w["confidence"] for w in words), default=1.0)
        return {
            "type": "Results",
            "channel_index": CHANNEL,
            "duration": round(end - start, 3),
            "start": round(start, 3),
            "is_final": is_final,
            "speech_final": speech_final,
            "from_finalize": from_finalize,
            "channel": {"alternatives": [{"transcript": transcript, "confidence": confidence, "words": words}]},
            "metadata": {"request_id": self.request_id, "model_info": self.model_info, "model_uuid": self.model_uuid},
        }

    def _metadata(self) -> dict:
        duration = self.decoder.input_seconds if self.decoder is not None else 0.0
        return {
            "type": "Metadata",
            "transaction_key": "deprecated",
            "request_id": self.request_id,
            "sha256": self.audio_hash.hexdigest(),
            "created": self.created,
            "duration": round(duration, 3),
            "channels": 1,
            "models": [self.model_uuid],
            "model_info": {self.model_uuid: self.model_info},
        }


def _message_type(text: str) -> str:
    """A text frame's `type`; ProtocolError for anything that is not a JSON object with a string type."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        raise ProtocolError("text frame is not JSON (expected KeepAlive, Finalize or CloseStream)") from None
    kind = message.get("type") if isinstance(message, dict) else None
    if not isinstance(kind, str):
        raise ProtocolError("text frame has no string `type` (expected KeepAlive, Finalize or CloseStream)")
    return kind
