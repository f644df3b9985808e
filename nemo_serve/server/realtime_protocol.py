"""OpenAI Realtime *transcription* protocol: typed client events, server events, the session config.

Two dialects, both read from the `openai` package's own types (3.57: openai/types/realtime/ and
openai/types/beta/realtime/):
  GA    session.update {session: {type: "transcription", audio: {input: {format: {type:
        "audio/pcm", rate: 24000}, transcription: {model, language, prompt}, turn_detection}}}}
        -> session.created / session.updated
  beta  transcription_session.update {session: {input_audio_format: "pcm16",
        input_audio_transcription: {model, language, prompt}, turn_detection}} (what NVIDIA NIM
        speaks; NIM adds input_audio_params.sample_rate_hz) -> transcription_session.created / .updated
Both: input_audio_buffer.append {audio: base64 PCM16} / .commit / .clear, NIM's
input_audio_buffer.done (end of input); server: input_audio_buffer.committed / .cleared /
.speech_started / .speech_stopped, conversation.item.input_audio_transcription.delta /
.completed, error {error: {type, code, message, param, event_id}}.

Unknown fields are ignored (clients send options of OpenAI's models that mean nothing here), unlike
/ws's config, which refuses them: these clients were written against another server, and refusing
what we do not use would break them for nothing. docs/protocol.md describes the same thing.
realtime_parse.py turns a text frame into one of these events.
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from ..engine.phrases import PhraseLimits, PhraseRequest, check_phrases
from .logsafe import preview
from .tokens import token_pieces

GA_RATE = 24000  # the only rate OpenAI's audio/pcm and beta pcm16 have
MAX_PREVIEW = 60
DIARIZING_MODEL = "gpt-4o-transcribe-diarize"  # OpenAI's diarizing transcriber: asks for speakers (realtime_speakers.py)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class _EventIds:
    """event_ids: a random per-process prefix and a counter, as new_id's shape (20 hex digits).
    Why not new_id: uuid4 cost 2.6 µs of every event of every result (a delta per partial), and an
    event id only labels the event (no client sends one back to find anything). Reset in a forked
    child, so two front ends never share a prefix."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix, self.numbers = os.urandom(6).hex(), itertools.count()

    def next(self) -> str:
        return f"event_{self.prefix}{next(self.numbers) & 0xFFFFFFFF:08x}"


new_event_id = _EventIds().next


class RealtimeError(ValueError):
    """A client event the server cannot use; answered with an `error` event, the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None, event_id=None):
        super().__init__(message)
        self.code, self.param, self.event_id = code, param, event_id


# ----------------------------------------------------------------------------- client -> server


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


_Ms = Annotated[int, Field(ge=0, le=3_600_000)]
# The latency mode, as /ws's config and URL name it; range-checked against the served modes later.
_Mode = Annotated[int, Field(ge=0, le=1000)]


TURN_DETECTION_TYPES = ("server_vad", "semantic_vad")  # OpenAI's; both run our endpointer


class TurnDetection(_Loose):
    type: str | None = None  # one of TURN_DETECTION_TYPES (checked in `_turn_detection`)
    silence_duration_ms: _Ms | None = None  # -> rule2 (silence after text)
    prefix_padding_ms: _Ms | None = None  # -> how far before the first token audio_start_ms points
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # echoed (see realtime.py)

    def echo(self) -> dict:
        return {"type": self.type or "server_vad", "silence_duration_ms": self.silence_duration_ms,
                "prefix_padding_ms": self.prefix_padding_ms, "threshold": self.threshold}  # fmt: skip


class Transcription(_Loose):
    model: str | None = None
    language: Annotated[str, Field(max_length=32)] | None = None
    prompt: str | None = None
    # Phrase boosting (nemo-serve's extension, as /ws's config names it): not `prompt`, which
    # OpenAI defines as free text for its gpt-4o transcribers ("expect words about technology"):
    # boosted as a phrase that text would be pushed into transcripts. Any: checked by
    # `transcription_phrases`, with the /ws messages.
    phrases: Any = None
    boost: Any = None
    # Speakers (nemo-serve's, as /ws's `diarization` option names them), with the diarizing model
    # only. Any: checked by realtime_speakers.transcription_diarization with /ws's rule and words.
    max_speakers: Any = None
    split_on_speaker_change: Any = None


def transcription_phrases(t: Transcription, limits: PhraseLimits, encodable: frozenset[str], tokenized: bool,
                          event_id: str | None) -> PhraseRequest | None:  # fmt: skip
    """The update's phrases, checked as /ws checks them; None if it names neither field."""
    if t.phrases is None and t.boost is None:
        return None
    try:
        return check_phrases(t.phrases, t.boost, limits, encodable, tokenized)
    except ValueError as e:
        raise RealtimeError(str(e), param="phrases", event_id=event_id) from None


class AudioFormat(_Loose):
    type: str | None = None  # audio/pcm (audio/pcmu, audio/pcma: not supported)
    rate: Annotated[int, Field(ge=8000, le=192000)] | None = None


class AudioInput(_Loose):
    format: AudioFormat | None = None
    transcription: Transcription | None = None
    turn_detection: TurnDetection | None = None


class GAAudio(_Loose):
    input: AudioInput | None = None


class GASession(_Loose):
    type: str | None = None
    context_right: _Mode | None = None  # nemo-serve's: the latency mode of the session's items
    audio: GAAudio | None = None


class InputAudioParams(_Loose):  # NIM's extension of the beta session
    sample_rate_hz: Annotated[int, Field(ge=8000, le=192000)] | None = None
    num_channels: Annotated[int, Field(ge=1, le=1)] | None = None


class BetaSession(_Loose):
    input_audio_format: str | None = None
    input_audio_transcription: Transcription | None = None
    turn_detection: TurnDetection | None = None
    input_audio_params: InputAudioParams | None = None
    context_right: _Mode | None = None


@dataclass
class SessionUpdate:
    """What one session.update / transcription_session.update asks for; None: leave as is."""

    dialect: str  # "ga" or "beta"
    event_id: str | None
    rate: int | None = None
    wav_header: bool | None = None  # NIM's input_audio_format "none": the audio may begin with a WAV header
    transcription: Transcription | None = None
    turn_detection_set: bool = False  # the field was present (null turns endpointing off)
    turn_detection: TurnDetection | None = None
    context_right: int | None = None
    nim: bool = False  # NIM's input_audio_params: a NIM client, whose commits are flushes (nim_items.py)


@dataclass
class Append:
    pcm: bytes
    event_id: str | None
    force_eou: bool = False  # NIM's runtime_config.force_eou: end the utterance after this audio


@dataclass
class BufferEvent:
    """input_audio_buffer.commit, .clear or .done."""

    kind: Literal["commit", "clear", "done"]
    event_id: str | None


ClientEvent = SessionUpdate | Append | BufferEvent


def check_model(name: str | None, served: str, event_id: str | None) -> None:
    """A transcription `model` the session may name: the served model (its name or the last part
    of its path), or one of OpenAI's transcription model names, which a client written for OpenAI
    sends unchanged and which this server answers with the model it serves. Anything else is
    refused with the served name, as Riva refuses an unknown model."""
    if not name or name in (served, served.rstrip("/").rsplit("/", 1)[-1]) or _openai_transcriber(name):
        return
    raise RealtimeError(f"transcription model {preview(name, MAX_PREVIEW)} is not served; served: {served} "
                        "(OpenAI's transcription model names, such as gpt-4o-transcribe and whisper-1, "
                        "also select it)", code="model_not_found", param="transcription.model", event_id=event_id)  # fmt: skip


def _openai_transcriber(name: str) -> bool:
    """whisper-1, gpt-4o-transcribe, gpt-4o-mini-transcribe(-date), gpt-realtime-whisper, ..."""
    return len(name) <= 64 and name.isascii() and (
        name == "whisper-1" or (name.startswith("gpt-") and ("transcribe" in name or "whisper" in name)))


def model_language(code: str | None, languages: list[str] | None) -> str | None:
    """An OpenAI client's ISO-639-1 code (`en`) -> the model's prompt code (`en-US`) where only one
    fits. A model without prompts has one language: the code is a hint, as OpenAI documents it,
    and is ignored. Raises RealtimeError for an unknown or ambiguous code."""
    if not code or not languages:
        return None
    by_lower = {c.lower(): c for c in languages}
    if code.lower() in by_lower:
        return by_lower[code.lower()]
    fits = sorted(c for c in languages if c.lower().split("-")[0] == code.lower())
    if len(fits) == 1:
        return fits[0]
    what = f"ambiguous (one of {', '.join(fits)})" if fits else f"unknown; valid: {', '.join(sorted(languages))}"
    raise RealtimeError(f"language {preview(code, 32)} is {what}", param="language")


# ----------------------------------------------------------------------------- the session


@dataclass
class RealtimeConfig:
    """The effective session, as session.created / .updated show it."""

    session_id: str = field(default_factory=lambda: new_id("sess"))
    rate: int = GA_RATE
    wav_header: bool = False  # input_audio_format "none" (NIM): a WAV header may lead the audio
    transcription_model: str | None = None  # echoed; the server has one model
    language: str | None = None  # as the client sent it
    prompt: str | None = None  # echoed, not used
    phrases: PhraseRequest | None = None  # boosted phrases (Transcription.phrases)
    max_speakers: int | None = None  # with the diarizing model; None: all the diarizer's speakers
    split_on_speaker_change: bool = False  # with the diarizing model: a speaker change ends the item
    turn_detection: TurnDetection | None = None  # None: endpointing off, the client commits
    context_right: int = 0  # the latency mode every item of the session runs at

    def ga(self) -> dict:
        """RealtimeTranscriptionSessionCreateResponse (GA): the session of session.created/updated."""
        td = None if self.turn_detection is None else self.turn_detection.echo()
        return {
            "type": "transcription",
            "id": self.session_id,
            "object": "realtime.transcription_session",
            "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": self.rate},
                "noise_reduction": None,
                "transcription": {"model": self.transcription_model, "language": self.language, "prompt": self.prompt,
                                  **self.speaker_fields()},
                "turn_detection": td,
            }},
            "include": [],
            "context_right": self.context_right,
        }  # fmt: skip

    def speaker_fields(self) -> dict:
        """The speaker options, echoed only while the diarizing model is named (they apply only then)."""
        if self.transcription_model != DIARIZING_MODEL:
            return {}
        return {"max_speakers": self.max_speakers, "split_on_speaker_change": self.split_on_speaker_change}

    def beta(self) -> dict:
        """TranscriptionSession (beta, as NIM shows it: with input_audio_params; no client secret)."""
        td = None if self.turn_detection is None else self.turn_detection.echo()
        return {
            "id": self.session_id,
            "object": "realtime.transcription_session",
            "modalities": ["text"],
            "input_audio_format": "none" if self.wav_header else "pcm16",
            "input_audio_params": {"sample_rate_hz": self.rate, "num_channels": 1},
            "input_audio_transcription": {"model": self.transcription_model, "language": self.language,
                                          "prompt": self.prompt, **self.speaker_fields()},
            "turn_detection": td,
            "client_secret": None,
            "context_right": self.context_right,
        }  # fmt: skip


# ----------------------------------------------------------------------------- server -> client


class ServerEvent(BaseModel):
    model_config = ConfigDict(extra="allow")  # the few events with dialect-dependent fields
    type: str
    event_id: str = Field(default_factory=new_event_id)


def event(type_: str, **fields) -> ServerEvent:
    return ServerEvent(type=type_, **fields)


class DeltaEvent(msgspec.Struct):
    """conversation.item.input_audio_transcription.delta, the one event of nearly every result,
    rendered without pydantic: the same JSON as `event(...)`'s, field for field and in the same
    order (tests/test_realtime_events.py), for a fraction of its CPU (with the cheaper event id and
    the item id made once: a partial rendered took 9.36 µs, now 2.06; packet_path_render_cpu.json)."""

    type: str
    event_id: str
    item_id: str
    content_index: int
    delta: str

    def model_dump_json(self) -> str:
        return _encode_event(self).decode()


_encode_event = msgspec.json.Encoder().encode


def delta_event(type_: str, item_id: str, delta: str) -> DeltaEvent:
    return DeltaEvent(type_, new_event_id(), item_id, 0, delta)


def error_event(message: str, *, type_: str = "invalid_request_error", code: str | None = None,
                param: str | None = None, event_id: str | None = None) -> ServerEvent:  # fmt: skip
    """OpenAI's error shape (RealtimeErrorEvent): {type: "error", event_id, error: {...}}."""
    return event("error", error={"type": type_, "code": code, "message": message, "param": param, "event_id": event_id})


def completed_event(r, item_id: str, vocabulary: list[str], item_start_s: float, last: bool, number: int) -> ServerEvent:
    """conversation.item.input_audio_transcription.completed for a final `r` (engine StreamResult),
    with what /ws's final carries in `nemo_serve` (times count from the item's engine stream,
    which begins at `item_start` of the session's audio). `number`: the item's among the
    completed events the session sent, its `nemo_serve.segment` (not r.segment, the session's
    key, which also counts the segments that were never sent: silence the endpointer closed)."""
    extra = {"is_last_result": True} if last else {}
    return event(
        "conversation.item.input_audio_transcription.completed", item_id=item_id, content_index=0, transcript=r.text,
        usage={"type": "duration", "seconds": round(max(0.0, r.audio_processed_s - r.segment_start_s), 3)},
        nemo_serve={
            "segment": number,
            "tokens": token_pieces(vocabulary, r.token_ids),
            "token_ids": r.token_ids,
            "timestamps": r.token_times_s,
            "words": [msgspec.structs.asdict(w) for w in r.words or ()],
            "start_time": r.segment_start_s,
            "audio_processed": r.audio_processed_s,
            "item_start": round(item_start_s, 3),
            "end_reason": r.end_reason,  # as /ws's final: "eou", "eob", "silence", ... (engine/results.py)
            "eou_probability": r.eou_probability,
            "eou_time": r.eou_time_s,
            "backchannel": r.backchannel,
        },
        **extra,
    )  # fmt: skip
