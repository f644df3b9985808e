"""/v1/realtime client events, text frame -> typed event (realtime_protocol.py declares the events):
the append fast path (msgspec, one C pass) and the general path (json + pydantic) that gives every
error. Unknown fields are ignored, as realtime_protocol.py's docstring says why."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import msgspec
from pydantic import ValidationError

from .logsafe import clean, preview
from .nim_items import wants_force_eou
from .realtime_protocol import (
    MAX_PREVIEW,
    TURN_DETECTION_TYPES,
    Append,
    AudioInput,
    BetaSession,
    BufferEvent,
    ClientEvent,
    GASession,
    RealtimeError,
    SessionUpdate,
    TurnDetection,
)


class _AppendWire(msgspec.Struct):
    """input_audio_buffer.append as nearly every client sends it, decoded JSON and base64 in one C
    pass (benchmarks/packet_cost.py: json.loads and binascii took about 30 us of a 20 ms packet's
    1,280 base64 characters, this about 6). msgspec's base64 takes a subset of what
    `base64.b64decode(validate=True)` takes (proper padding only), with the same bytes; the rest,
    and every other event, goes the general way, which gives the errors."""

    type: str
    audio: bytes
    event_id: Any = None
    runtime_config: Any = None


_append_decoder = msgspec.json.Decoder(_AppendWire)


def _plain_append(text: str) -> Append | None:
    """The append fast path (see _AppendWire); None: parse it the general way."""
    try:
        a = _append_decoder.decode(text)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    if a.type != "input_audio_buffer.append" or len(a.audio) % 2:
        return None
    event_id = clean(a.event_id, 64) if isinstance(a.event_id, str) else None
    return Append(a.audio, event_id, wants_force_eou(a.runtime_config))


def parse_client_event(text: str) -> ClientEvent:
    """A text frame -> event; raises RealtimeError with a message fit for the wire."""
    append = _plain_append(text)
    if append is not None:
        return append
    return parse_client_event_generally(text)


def parse_client_event_generally(text: str) -> ClientEvent:
    """parse_client_event without the append fast path: the reference it is tested against."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError):
        raise RealtimeError("the event is not valid JSON", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise RealtimeError("an event must be a JSON object", code="invalid_json")
    kind, event_id = obj.get("type"), obj.get("event_id")
    event_id = clean(event_id, 64) if isinstance(event_id, str) else None
    if not isinstance(kind, str):
        raise RealtimeError("missing or invalid 'type'", code="invalid_event", param="type", event_id=event_id)
    try:
        if kind == "input_audio_buffer.append":
            return Append(_audio(obj.get("audio"), event_id), event_id, wants_force_eou(obj.get("runtime_config")))
        if kind.startswith("input_audio_buffer.") and kind[19:] in ("commit", "clear", "done"):
            return BufferEvent(kind[19:], event_id)
        if kind == "session.update":
            return _ga_update(obj.get("session"), event_id)
        if kind == "transcription_session.update":
            return _beta_update(obj.get("session"), event_id)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        where = clean(".".join(str(p) for p in ("session", *first["loc"])))
        raise RealtimeError(f"{where}: {clean(first['msg'], 200)}", param=where, event_id=event_id) from None
    raise RealtimeError(
        f"event type {preview(kind, MAX_PREVIEW)} is not supported by a transcription session",
        code="unsupported_event", param="type", event_id=event_id,
    )  # fmt: skip


def _audio(data: Any, event_id: str | None) -> bytes:
    if not isinstance(data, str):
        raise RealtimeError("'audio' must be a base64 string", param="audio", event_id=event_id)
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError("'audio' is not valid base64", code="invalid_base64", param="audio", event_id=event_id) from None
    if len(pcm) % 2:
        raise RealtimeError(f"'audio' of {len(pcm)} bytes is not whole 16-bit samples", param="audio", event_id=event_id)
    return pcm


def _ga_update(raw: Any, event_id: str | None) -> SessionUpdate:
    s = GASession.model_validate(raw if raw is not None else {})
    if s.type not in (None, "transcription"):
        raise RealtimeError(
            f"session.type {preview(s.type, MAX_PREVIEW)}: this server only has transcription sessions",
            param="session.type", event_id=event_id,
        )  # fmt: skip
    inp = s.audio.input if s.audio is not None and s.audio.input is not None else AudioInput()
    raw_input = ((raw or {}).get("audio") or {}).get("input") or {}  # validated: dicts or None
    update = SessionUpdate("ga", event_id, transcription=inp.transcription, context_right=s.context_right)
    if inp.format is not None:
        if inp.format.type not in (None, "audio/pcm"):
            raise RealtimeError(
                f"audio format {preview(inp.format.type, MAX_PREVIEW)} is not supported; use audio/pcm",
                param="session.audio.input.format.type", event_id=event_id,
            )  # fmt: skip
        update.rate = inp.format.rate
    if "turn_detection" in raw_input:
        td = _turn_detection(inp.turn_detection, "session.audio.input.turn_detection.type", event_id)
        update.turn_detection_set, update.turn_detection = True, td
    return update


def _beta_update(raw: Any, event_id: str | None) -> SessionUpdate:
    raw = raw if raw is not None else {}
    s = BetaSession.model_validate(raw)
    if s.input_audio_format not in (None, "pcm16", "none"):
        raise RealtimeError(
            f"input_audio_format {preview(s.input_audio_format, MAX_PREVIEW)} is not supported; use pcm16",
            param="session.input_audio_format", event_id=event_id,
        )  # fmt: skip
    update = SessionUpdate("beta", event_id, transcription=s.input_audio_transcription, context_right=s.context_right)
    if s.input_audio_format is not None:  # "none": NVIDIA's client sends a file as is (wav_stream.py)
        update.wav_header = s.input_audio_format == "none"
    if s.input_audio_params is not None:
        update.rate = s.input_audio_params.sample_rate_hz
        update.nim = True
    if isinstance(raw, dict) and "turn_detection" in raw:
        td = _turn_detection(s.turn_detection, "session.turn_detection.type", event_id)
        update.turn_detection_set, update.turn_detection = True, td
    return update


def _turn_detection(td: TurnDetection | None, param: str, event_id: str | None) -> TurnDetection | None:
    if td is not None and td.type is not None and td.type not in TURN_DETECTION_TYPES:
        raise RealtimeError(f"turn_detection.type {preview(td.type, MAX_PREVIEW)} is not supported; valid: "
                            f"{', '.join(TURN_DETECTION_TYPES)}, or null for none", param=param, event_id=event_id)  # fmt: skip
    return td
