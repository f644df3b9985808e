"""Riva ASR messages <-> this server's streams: request configs in, results out. No network here.

  RecognitionConfig      -> RivaConfig (checked; RivaRequestError says why, sent as INVALID_ARGUMENT)
  audio bytes            -> LeadingWav strips a WAV header (riva.client sends files as they are)
  StreamResult           -> StreamingRecognitionResult / SpeechRecognitionResult

Field mapping (docs/protocol.md, "Riva ASR over gRPC"):
  encoding               LINEAR_PCM (or unspecified): 16-bit signed little-endian; others refused
  sample_rate_hertz      any rate 8-192 kHz, resampled as /ws does; 0: the WAV header's, else the model's
  audio_channel_count    1 (or 0); more is refused
  language_code          a prompt model's language (checked); a model without prompts ignores it
  model                  "" or the model's name: the default mode; "<name>@<chunk_ms>ms": that mode
  endpointing_config     stop_history (ms) -> rule 2, trailing silence after text; the rest has
                         no counterpart in a decoder-driven endpointer and is ignored
  speech_contexts        phrases + boost -> the stream's `phrases` / `boost` (engine/phrases.py checks
                         them as for /ws); several contexts merge when they share one boost
  custom_configuration   "eou": "false" turns an EOU model's segment endings off (engine/eou.py); an
                         <EOU>/<EOB> otherwise ends the segment: a final result (is_final, stability
                         1; Riva's proto has no end-of-utterance field, so an EOB is a final too)
  max_alternatives       accepted; one alternative (greedy RNN-T decoding has one hypothesis)
  enable_word_time_offsets  words with start/end in ms on finals
  diarization_config     enable_speaker_diarization -> the stream's `diarization` (a --diarizer server
                         only); max_speaker_count 1..the diarizer's speakers (0: all of them); each
                         final's WordInfo carries speaker_tag, the word's speaker + 1 (Riva's tags
                         start at 1; 0 means none), words sent even without enable_word_time_offsets;
                         custom_configuration "split_on_speaker_change": "true" (Riva's proto has no
                         such field) ends a final where the speaker changes (diarization on only)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

from ..engine.endpoint import EndpointConfig
from ..engine.geometry import ModelInfo
from ..engine.results import StreamResult
from .logsafe import preview

MIN_RATE, MAX_RATE = 8000, 192000  # as /ws's config
MAX_WAV_HEADER_BYTES = 64 * 1024  # RIFF chunks before `data` (fmt, LIST, ...); more is not a header
# Our partials only grow within a segment (cache-aware decoding never revises an emitted token),
# so an interim transcript is as stable as a final one.
INTERIM_STABILITY = 1.0
WAVE_FORMAT_PCM, WAVE_FORMAT_EXTENSIBLE = 1, 0xFFFE


class RivaRequestError(ValueError):
    """The request cannot be served as asked; the message goes to the client."""


@dataclass(frozen=True)
class RivaConfig:
    """What this server takes from a RecognitionConfig."""

    sample_rate: int | None  # None: the WAV header's rate, else the model's
    language: str | None  # a prompt model's language; None for a model without prompts
    context_right: int | None  # None: the default mode
    endpoint: EndpointConfig
    interim_results: bool
    word_time_offsets: bool
    phrases: list[str] | None = None  # speech_contexts' phrases, checked by the engine's open_stream
    boost: float | None = None  # None: the server's default boost
    diarization: dict | None = None  # the engine's `diarization` option; None: no speakers


def mode_model_name(model: ModelInfo, context_right: int) -> str:
    return f"{model.name}@{model.geometry_for(context_right).chunk_ms:g}ms"


def parse_config(config, model: ModelInfo, base_endpoint: EndpointConfig, interim_results: bool,
                 encodings) -> RivaConfig:  # fmt: skip
    """`config`: a riva_asr_pb2.RecognitionConfig; `encodings`: riva_audio_pb2.AudioEncoding (the
    enum, so a refusal names the encoding as the client wrote it: FLAC, not 2)."""
    if config.encoding not in (0, encodings.LINEAR_PCM):
        name = encodings.Name(config.encoding) if config.encoding in encodings.values() else config.encoding
        raise RivaRequestError(f"encoding {name} is not served; send LINEAR_PCM (16-bit signed little-endian)")
    rate = config.sample_rate_hertz or None
    if rate is not None:
        check_rate(rate, "sample_rate_hertz")
    if config.audio_channel_count > 1:
        raise RivaRequestError(f"audio_channel_count {config.audio_channel_count}: only mono audio is served")
    language = None
    if model.prompt_dictionary:
        language = config.language_code or None
        try:
            model.language_index(language)
        except ValueError:  # its reason quotes the code whole
            codes = ", ".join(sorted(model.prompt_dictionary))
            raise RivaRequestError(f"unknown language_code {preview(language)}; valid: {codes}") from None
    endpoint = base_endpoint
    if config.HasField("endpointing_config") and config.endpointing_config.stop_history:
        stop_ms = config.endpointing_config.stop_history
        try:
            endpoint = replace(base_endpoint, rule2_min_trailing_silence_s=stop_ms / 1000.0).validated()
        except ValueError:
            raise RivaRequestError(f"endpointing_config.stop_history {stop_ms} ms is outside (0, 3600000]") from None
    endpoint = _eou_option(config.custom_configuration, endpoint)
    return RivaConfig(
        sample_rate=rate,
        language=language,
        context_right=_mode(config.model, model),
        endpoint=endpoint,
        interim_results=interim_results,
        word_time_offsets=config.enable_word_time_offsets,
        diarization=_diarization(config, model.num_speakers),
        **_boosting(config.speech_contexts),
    )


def _eou_option(custom: dict, endpoint: EndpointConfig) -> EndpointConfig:
    """custom_configuration {"eou": "false"}: no segment ends at an EOU model's <EOU>/<EOB> (Riva's
    proto has no such field; its custom map is where Riva's own servers take per-stream options)."""
    value = custom.get("eou")
    if value is None:
        return endpoint
    if value.lower() not in ("true", "false"):
        raise RivaRequestError(f"custom_configuration eou={preview(value)}: use true or false")
    return replace(endpoint, eou=value.lower() == "true")


def _diarization(config, num_speakers: int | None) -> dict | None:
    """diarization_config checked here, before admission, in Riva's names (the engine checks the
    same again in its own). Not enabled: None, whatever max_speaker_count says (Riva ignores it)."""
    split = _split_option(config.custom_configuration)
    if not (config.HasField("diarization_config") and config.diarization_config.enable_speaker_diarization):
        if split:
            raise RivaRequestError("custom_configuration split_on_speaker_change=true needs "
                                   "diarization_config.enable_speaker_diarization")  # fmt: skip
        return None
    if num_speakers is None:
        raise RivaRequestError("diarization_config: this server has no diarizer loaded (start it with --diarizer)")
    count = config.diarization_config.max_speaker_count
    if not 0 <= count <= num_speakers:
        raise RivaRequestError(f"diarization_config.max_speaker_count {count}: this diarizer tells at most "
                               f"{num_speakers} speakers apart (0: all of them)")  # fmt: skip
    return {"max_speakers": count or num_speakers, "split_on_speaker_change": split}


def _split_option(custom: dict) -> bool:
    """custom_configuration {"split_on_speaker_change": "true"}: /ws's diarization option of that
    name, in Riva's map of per-stream options (its proto has no field for it)."""
    value = custom.get("split_on_speaker_change", "false")
    if value.lower() not in ("true", "false"):
        raise RivaRequestError(f"custom_configuration split_on_speaker_change={preview(value)}: use true or false")
    return value.lower() == "true"


def check_rate(rate: int, where: str) -> None:
    """Every declared rate (the config's, a WAV header's) before any audio is decoded at it: a
    1 Hz header made 4 kB of PCM 2,048 s of model-rate audio (issue 45)."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise RivaRequestError(f"{where} {rate} Hz is outside the served {MIN_RATE}..{MAX_RATE} Hz")


def _boosting(contexts) -> dict:
    """speech_contexts as one phrase list and one boost. A stream has one boosting tree with one
    weight (NeMo's multi-model gives each decoder row a single tree), so contexts with different
    boosts are refused rather than silently re-weighted. proto3 cannot tell an unset boost from 0:
    0 means the server's default; a negative boost (Riva's way to suppress words) is passed on
    and refused by the same check as /ws's `boost`."""
    contexts = [c for c in contexts if c.phrases]
    if not contexts:
        return {}
    boosts = sorted({c.boost for c in contexts})
    if len(boosts) > 1:
        raise RivaRequestError(
            f"speech_contexts with different boosts ({', '.join(f'{b:g}' for b in boosts)}): this server boosts "
            "a stream's phrases with one weight; send them in one context, or in contexts of equal boost"
        )
    return {"phrases": [p for c in contexts for p in c.phrases], "boost": boosts[0] or None}


def _mode(name: str, model: ModelInfo) -> int | None:
    if name in ("", model.name):
        return None
    by_name = {mode_model_name(model, r): r for r in model.modes}
    if name not in by_name:
        raise RivaRequestError(f"unknown model {preview(name)}; served: {', '.join([model.name, *by_name])}")
    return by_name[name]


class LeadingWav:
    """Strips a WAV header from the start of a stream's audio, however it is split into messages.

    riva.client's AudioChunkFileIterator and offline_recognize send a WAV file's bytes as they are,
    header included (Riva's server reads it); taken as samples, its 44 bytes would be 22 samples
    of noise in front of the speech. Audio that does not start with RIFF....WAVE passes untouched."""

    def __init__(self) -> None:
        self._head = b""
        self._pos = 12  # the next RIFF chunk to read, after "RIFF", size, "WAVE"
        self.done = False
        self.sample_rate: int | None = None  # the header's, once read

    def feed(self, data: bytes) -> bytes:
        """The PCM bytes of `data` (empty while the header is still arriving)."""
        if self.done:
            return data
        self._head += data
        head = self._head
        if not (head[:4] == b"RIFF"[: len(head)] and head[8:12] == b"WAVE"[: max(0, len(head) - 8)]):
            return self._pass(head)
        pos = self._pos  # resume after the chunks already read: re-reading them on every message
        # made a header of 4,000 empty chunks, 8 bytes a message, cost 9 s of the event loop
        while pos + 8 <= len(head):
            chunk_id, size = head[pos : pos + 4], struct.unpack_from("<I", head, pos + 4)[0]
            if chunk_id == b"data":
                return self._pass(head[pos + 8 :])
            if chunk_id == b"fmt ":
                if pos + 8 + size > len(head):
                    break
                self._check_format(head[pos + 8 : pos + 8 + size])
            pos += 8 + size + (size & 1)  # RIFF chunks are word-aligned
            self._pos = pos
        if len(head) > MAX_WAV_HEADER_BYTES:
            raise RivaRequestError(f"WAV header without a data chunk in its first {MAX_WAV_HEADER_BYTES} bytes")
        return b""

    def flush(self) -> bytes:
        """End of input: bytes held back that never became a header are audio."""
        if self.done:
            return b""
        if len(self._head) >= 12:  # RIFF....WAVE seen: a header that never reached its data
            raise RivaRequestError("the audio ended inside its WAV header")
        return self._pass(self._head)

    def _pass(self, data: bytes) -> bytes:
        self.done, self._head = True, b""
        return data

    def _check_format(self, fmt: bytes) -> None:
        if len(fmt) < 16:
            raise RivaRequestError("WAV header: fmt chunk too short")
        tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", fmt)
        if tag == WAVE_FORMAT_EXTENSIBLE and len(fmt) >= 26:
            tag = struct.unpack_from("<H", fmt, 24)[0]  # the sub-format GUID's first two bytes
        if tag != WAVE_FORMAT_PCM or bits != 16:
            raise RivaRequestError(f"WAV audio is format {tag}, {bits}-bit; LINEAR_PCM is 16-bit PCM")
        if channels != 1:
            raise RivaRequestError(f"WAV audio has {channels} channels: only mono audio is served")
        check_rate(rate, "WAV header says")
        self.sample_rate = rate


def alternative(pb, r: StreamResult, word_times: bool):
    """`pb`: riva_asr_pb2. One SpeechRecognitionAlternative: the segment's text, words on finals
    (asked for, or a diarized stream's: its speakers are on its words)."""
    alt = pb.SpeechRecognitionAlternative(transcript=r.text)
    if r.is_final:
        confidences = [w.confidence for w in r.words or () if w.confidence is not None]
        alt.confidence = min(confidences) if confidences else 1.0  # no scores (no --word-confidence): 1.0
        if word_times or r.word_speakers is not None:
            tags = [k + 1 for k in r.word_speakers] if r.word_speakers is not None else [0] * len(r.words or ())
            alt.words.extend(
                pb.WordInfo(word=w.word, start_time=round(w.start * 1000), end_time=round(w.end * 1000),
                            confidence=w.confidence if w.confidence is not None else 1.0, speaker_tag=tag)  # fmt: skip
                for w, tag in zip(r.words or (), tags)
            )
    return alt


def streaming_result(pb, r: StreamResult, word_times: bool):
    return pb.StreamingRecognitionResult(
        alternatives=[alternative(pb, r, word_times)],
        is_final=r.is_final,
        stability=1.0 if r.is_final else INTERIM_STABILITY,
        channel_tag=1,
        audio_processed=r.audio_processed_s,
    )


def offline_result(pb, r: StreamResult, word_times: bool):
    return pb.SpeechRecognitionResult(
        alternatives=[alternative(pb, r, word_times)], channel_tag=1, audio_processed=r.audio_processed_s
    )
