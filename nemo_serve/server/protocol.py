"""The WebSocket protocol: typed messages, close codes and the per-socket state machine.

Client -> server
  text   {"type": "config", ...}         optional, first message only (ConfigMessage)
  binary PCM samples                      any number of whole samples per frame
  text   {"type": "force_final"}          close the current segment now (a final result)
  text   {"type": "end"}, "Done" or "eof" end of input ("Done" is what sherpa-onnx clients send)
Server -> client (JSON text frames)
  ready -> partial* / final* -> done, or error at any point; then the server closes.
  A client that ended with the bare text "Done" or "eof" also gets the text "Done!" just before
  `done`, as sherpa-onnx's server sends it after the last result.
The URL may carry ?encoding=&sample_rate=: the defaults for a client that sends no config (or a
config without those fields); --default-encoding is the server-wide default.

docs/protocol.md is the user-facing description of the same thing; keep the two in step.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .logsafe import clean, preview

# Close codes (RFC 6455 section 7.4.1). Every close but 1000 is preceded by an `error` message,
# except 1009, which the transport sends itself (the oversized frame is never read).
CLOSE_NORMAL = 1000
CLOSE_PROTOCOL_ERROR = 1008  # policy violation: bad message, bad audio, limits, idle
CLOSE_TOO_BIG = 1009
CLOSE_SERVER_ERROR = 1011
CLOSE_GOING_AWAY = 1012  # service restart: drain deadline passed
CLOSE_TRY_AGAIN_LATER = 1013  # no free slot

MAX_CLOSE_REASON_BYTES = 123  # RFC 6455 5.5: a control frame's payload is 125 bytes, 2 are the code
MAX_REASON_CHARS = 500  # an `error` message's reason (the language list of a prompt model fits)

END_OF_INPUT_TEXTS = ("Done", "eof")  # sherpa-onnx clients send "Done"
END_OF_INPUT_REPLY = "Done!"  # what sherpa-onnx's server sends after the last result
ENCODINGS = ("pcm_f32le", "pcm_s16le")

ENCODING_ALIASES = {
    "pcm_f32le": "pcm_f32le",
    "f32le": "pcm_f32le",
    "float32": "pcm_f32le",
    "pcm_s16le": "pcm_s16le",
    "s16le": "pcm_s16le",
    "int16": "pcm_s16le",
}


class ProtocolError(ValueError):
    """The client broke the protocol; the reason goes on the wire."""


class ProtocolState(enum.Enum):
    """Where one socket is. Only the transitions in _TRANSITIONS are legal."""

    CONNECTED = "connected"  # accepted, no slot yet: waiting for the first message
    STREAMING = "streaming"  # slot held, audio accepted
    ENDING = "ending"  # input ended (client, drain or limit); waiting for the final result
    CLOSED = "closed"


_TRANSITIONS = {
    ProtocolState.CONNECTED: {ProtocolState.STREAMING, ProtocolState.CLOSED},
    ProtocolState.STREAMING: {ProtocolState.ENDING, ProtocolState.CLOSED},
    ProtocolState.ENDING: {ProtocolState.CLOSED},
    ProtocolState.CLOSED: set(),
}


def check_transition(old: ProtocolState, new: ProtocolState) -> ProtocolState:
    if new not in _TRANSITIONS[old]:
        raise RuntimeError(f"illegal protocol transition {old.value} -> {new.value}")
    return new


def close_reason(reason: str) -> str:
    """`reason` cut to 123 bytes of UTF-8, on a character boundary. A longer one makes the
    close frame invalid and the client sees an abnormal close (1006) instead of our code."""
    data = reason.encode("utf-8", "replace")[:MAX_CLOSE_REASON_BYTES]
    return data.decode("utf-8", "ignore")


# ----------------------------------------------------------------------------- client -> server


def mode_number(text: str) -> int | None:
    """A latency mode (`context_right`) given as text, or None when it is not 1 to 4 ASCII digits:
    checked before int(), which takes '\xb2' and would echo a bad value whole in its error, or
    refuse 5,000 digits with an error of its own. Whether the mode is served is the caller's check."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 4 else None


class _Strict(BaseModel):
    # Unknown fields are refused: a misspelt option should fail loudly, not be ignored.
    model_config = ConfigDict(extra="forbid")


class EndpointOptions(_Strict):
    """Per-stream override of the server's endpoint rules; omitted fields keep the server's value."""

    enabled: bool | None = None
    rule1_min_trailing_silence_s: Annotated[float, Field(gt=0, le=3600)] | None = None
    rule2_min_trailing_silence_s: Annotated[float, Field(gt=0, le=3600)] | None = None
    rule3_min_utterance_length_s: Annotated[float, Field(gt=0, le=3600)] | None = None
    eou: bool | None = None  # end segments at an EOU model's <EOU>/<EOB> tokens (engine/eou.py)


class DiarizationOptions(_Strict):
    max_speakers: Annotated[int, Field(ge=1, le=64)] | None = None  # None: all the diarizer's (4)
    split_on_speaker_change: bool = False  # a speaker change ends the segment (end_reason "speaker_change")


class ConfigMessage(_Strict):
    type: Literal["config"] = "config"
    id: Annotated[str, Field(max_length=128)] | None = None  # chosen by the client, echoed in every reply
    sample_rate: Annotated[int, Field(ge=8000, le=192000)] | None = None  # None: the model's rate
    encoding: str = "pcm_f32le"
    interim_results: bool = True
    endpointing: EndpointOptions | None = None
    language: Annotated[str, Field(max_length=32)] | None = None
    # The stream's chunk mode: a right context the server was started with (--context-right);
    # None: the server's default (the first). Chunk = (context_right + 1) x 80 ms.
    context_right: Annotated[int, Field(ge=0, le=10000)] | None = None
    # Phrase boosting, named as Riva's SpeechContext names them: words or phrases this stream
    # expects (names, terms) and the weight added per matched token (default 1). Checked against
    # the server's limits and the model's vocabulary before any audio (engine/phrases.py).
    phrases: list[str] | None = None
    boost: float | None = None
    # Who spoke (docs/diarization.md): speakers on tokens, words and finals, from the server's
    # --diarizer; refused before any audio when the server has none.
    diarization: DiarizationOptions | None = None

    @field_validator("encoding")
    @classmethod
    def _encoding(cls, v: str) -> str:
        try:
            return ENCODING_ALIASES[v.lower()]
        except KeyError:
            raise ValueError(f"encoding must be one of {list(ENCODINGS)}") from None


class EndMessage(_Strict):
    type: Literal["end"]


class BareEndMessage(EndMessage):
    """End of input as the bare text "Done" or "eof": answered with the text "Done!" as well.
    Never parsed from JSON ({"type": "end"} is an EndMessage), so our own clients, which parse
    every frame as JSON, never see the bare text."""


class ForceFinalMessage(_Strict):
    type: Literal["force_final"]


ClientMessage = ConfigMessage | EndMessage | ForceFinalMessage
_CLIENT_TYPES = {"config": ConfigMessage, "end": EndMessage, "force_final": ForceFinalMessage}


def parse_client_text(text: str) -> ClientMessage:
    """A text frame -> message; raises ProtocolError with a reason fit for the wire."""
    if text.strip() in END_OF_INPUT_TEXTS:
        return BareEndMessage(type="end")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise ProtocolError("text frame is neither JSON nor 'Done' or 'eof'") from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except ValueError:  # Python refuses integers of more than 4,300 digits
        raise ProtocolError("JSON number too long") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a JSON message must be an object")
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in _CLIENT_TYPES:  # a list or dict is not even hashable
        raise ProtocolError(f"unknown message type {preview(kind)}; expected one of {sorted(_CLIENT_TYPES)}")
    try:
        return _CLIENT_TYPES[kind].model_validate(obj)
    except ValidationError as e:
        raise ProtocolError(f"invalid {kind} message: {_first_error(e, kind)}") from None


_QUERY_FIELDS = ("encoding", "sample_rate", "context_right")


def parse_query_config(params: Mapping[str, str], default_encoding: str) -> ConfigMessage:
    """`?encoding=&sample_rate=&context_right=` on the URL over --default-encoding: the config of a
    client that sends none, and the defaults of one that does. Other parameters (token, ...) are not ours."""
    fields = {"encoding": default_encoding}
    fields.update({k: v for k, v in params.items() if k in _QUERY_FIELDS})
    try:
        return ConfigMessage.model_validate(fields)  # the same checks as a config message's fields
    except ValidationError as e:
        raise ProtocolError(f"invalid query parameter {_first_error(e, 'query')}") from None


def with_defaults(config: ConfigMessage, defaults: ConfigMessage) -> ConfigMessage:
    """A client's config, with the encoding, rate and mode it left out taken from `defaults` (the URL's)."""
    unset = {k: getattr(defaults, k) for k in _QUERY_FIELDS if k not in config.model_fields_set}
    return config.model_copy(update=unset)


def _first_error(e: ValidationError, kind: str) -> str:
    first = e.errors(include_url=False, include_input=False)[0]
    where = clean(".".join(str(p) for p in first["loc"]) or kind)  # field names come from the client
    return f"{where}: {clean(first['msg'], 200)}"


# ----------------------------------------------------------------------------- server -> client


class ReadyMessage(BaseModel):
    type: Literal["ready"] = "ready"
    id: str | None
    stream_id: str
    chunk_ms: float  # audio per model step (the stream's mode)
    context_right: int  # the stream's chunk mode
    sample_rate: int  # the model's rate; other input rates are resampled on the server
    input_sample_rate: int
    encoding: str
    interim_results: bool
    language: str | None
    max_message_bytes: int


class ResultMessage(BaseModel):
    type: Literal["partial", "final"]
    id: str | None
    stream_id: str
    segment: int
    is_final: bool
    text: str  # the segment's text so far (partial) or all of it (final)
    tokens: list[str]  # the segment's tokens ...
    token_ids: list[int]
    timestamps: list[float]  # ... and their start times in seconds from the start of the stream
    # A partial of a long segment carries it from these offsets on (what the client already has
    # stays): tokens, token_ids and timestamps from token_offset, text from text_offset (code
    # points). 0 and 0 (the whole segment) for finals and for segments of up to 256 tokens.
    token_offset: int = 0
    text_offset: int = 0
    start_time: float  # start of the segment, seconds from the start of the stream
    audio_processed: float  # seconds of audio the model has consumed
    audio_arrival_time: float  # server clock (unix s) when the audio that produced this arrived
    sent_time: float  # server clock (unix s) when this was sent


class WordInfo(BaseModel):
    word: str
    start: float  # seconds from the start of the stream: the word's first token
    end: float  # the end of its last token's frame (engine/words.py)
    confidence: float | None  # 0..1, the least of its tokens' (--word-confidence); null when off


class FinalMessage(ResultMessage):
    """A `final`: a `ResultMessage` with the segment's words (their text joined by single spaces
    is the final's text with runs of spaces collapsed)."""

    words: list[WordInfo]
    # Why the segment ended (engine/results.py END_REASONS): "eou" / "eob" (an EOU model's token,
    # with its probability), "silence" / "max_length" (the endpoint rules), "force_final", "end_of_input".
    end_reason: str | None = None
    eou_probability: float | None = None
    eou_time: float | None = None  # "eou"/"eob": the token's audio time (s), the turn's end
    backchannel: bool = False  # "eob": an acknowledgement ("uh-huh"), not a turn


class SpeakerWordInfo(WordInfo):
    speaker: int  # 0-based: who said it (its first token's speaker)


class DiarizedResultMessage(ResultMessage):
    """A diarized stream's partial: a `ResultMessage` with each token's speaker."""

    speakers: list[int]  # one per entry of tokens: 0-based speaker index


class DiarizedFinalMessage(FinalMessage):
    """A diarized stream's final: speakers on tokens and words, and the segment's speaker (the
    speaker of most of its tokens; null for a segment without tokens)."""

    speakers: list[int]
    words: list[SpeakerWordInfo]
    speaker: int | None


class ErrorMessage(BaseModel):
    type: Literal["error"] = "error"
    id: str | None = None
    reason: str


class DoneMessage(BaseModel):
    type: Literal["done"] = "done"
    id: str | None
    stream_id: str | None
    audio_processed: float
    reason: str  # why input ended: "end" (client), "draining" (server shutdown), "max_stream_duration"
