"""POST /v1/audio/transcriptions: OpenAI's file transcription, served by the streaming engine.

  multipart/form-data fields (OpenAI's names):
    file             required; any format file_audio.py reads, at any rate
    response_format  json (default), text, verbose_json, srt, vtt, diarized_json (a server with
                     --diarizer: who spoke, OpenAI's TranscriptionDiarized; 400 without one)
    language         ISO-639-1 (`en`) or the model's own code (`en-US`); chooses the prompt of a
                     multilingual prompt model, a hint otherwise
    context_right    the latency mode, as /ws takes it (also `?context_right=` on the URL)
    model, prompt, temperature, timestamp_granularities[], chunking_strategy, include[]:
                     accepted and ignored (one model; greedy decoding; verbose_json always
                     carries segments and words; the engine chunks the audio itself)
    known_speaker_names[], known_speaker_references[]: refused (400): speakers are not matched
                     to reference voices here
    max_speakers     nemo-serve's, as /ws's diarization option (the SDK sends it with extra_body):
                     1..the diarizer's speakers, with diarized_json (default: all of them)
    split_on_speaker_change  nemo-serve's, `true`: a segment (a verbose_json segment, an srt/vtt
                     cue, a diarized_json final) ends where the speaker changes; diarizes the
                     stream with any response_format (a --diarizer server only)
    stream           `true` is refused: no server-sent events here

Order of checks, cheapest first: a browser's Origin (403, as for the sockets), bearer token
(401), admission (503, /ws's reasons, before the body is read), body size (413 from
Content-Length, or while reading; 408 if it stops coming, 499 if the client leaves), form and
fields (400), audio (400 for a header beyond file_audio.py's rate and channel limits; 413 over
--max-stream-s or its decoding budget, from the header, before decoding; decoded in a worker
thread), then the slot (503 if another request took the last one).
Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}, which its SDK raises
as exceptions carrying the message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from ..engine.results import StreamResult
from . import transcript_formats as fmt
from .auth import authorized
from .context import Refused, ServerContext
from .file_audio import FileAudioError, FileTooLong, decode_file
from .file_transcription import FileTranscription, TranscriptionFailed
from .logsafe import preview
from .protocol import mode_number
from .realtime_protocol import RealtimeError, model_language

log = logging.getLogger("nemo_serve.transcriptions")

FORM_OVERHEAD_BYTES = 64 * 1024  # the other fields and the multipart framing, beyond the file
MAX_FIELDS = 32
MAX_FIELD_BYTES = 4096  # a prompt longer than this is refused (it is ignored anyway)
# How long a request may wait for its finals beyond its audio's duration: an engine that admits
# a stream keeps up with real time (admission.py), so it finishes within the audio's duration.
TIMEOUT_MARGIN_S = 30.0
# Files decoded at once per front end, each in a worker thread: each holds up to file_audio.py's
# stated peak, so this bounds the front end's decoding memory; others wait their turn.
MAX_CONCURRENT_DECODES = 2


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def add_transcription_routes(app: FastAPI, ctx: ServerContext, origin_refusal: Callable[[Request], str | None]) -> None:
    """`origin_refusal`: why a browser's Origin is refused (app.py's rule for the sockets), or None."""
    decoding = file_decoding(app)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        try:
            bad_origin = origin_refusal(request)
            if bad_origin is not None:
                ctx.metrics.refusals.labels(reason="origin").inc()
                raise RequestError(403, bad_origin)
            return await _transcribe(request, ctx, decoding)
        except RequestError as e:
            ctx.metrics.file_transcriptions.labels(status=str(e.status)).inc()
            return error_response(e.status, e.message, param=e.param, code=e.code)


async def _transcribe(request: Request, ctx: ServerContext, decoding: asyncio.Semaphore) -> Response:
    if not authorized(request, ctx.settings.auth_token):
        ctx.metrics.refusals.labels(reason="unauthorized").inc()
        raise RequestError(401, "missing or wrong bearer token", code="invalid_api_key")
    try:
        ctx.admit()  # early, before the upload is read; the job takes its slot with admit() again
    except Refused as e:
        raise RequestError(503, e.reason, code=e.label) from None
    form = await _read_form(request, ctx.settings.max_file_bytes)
    try:
        options = _options(form, request.query_params, ctx)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise RequestError(400, "missing 'file': the audio, as a multipart file field", param="file")
        data = await upload.read()
    finally:
        await form.close()
    samples, duration_s = await decode_upload(data, ctx, decoding)
    finals = await transcribe_samples(ctx, request, samples, duration_s, options["language"], options["context_right"],
                                      options["diarization"])  # fmt: skip
    ctx.metrics.file_transcriptions.labels(status="200").inc()
    return _render(finals, duration_s, options)


def file_decoding(app: FastAPI) -> asyncio.Semaphore:
    """The front end's decoding permits, one set per app whatever route uploads the file (this one,
    Deepgram's /v1/listen): MAX_CONCURRENT_DECODES bounds the decoding memory of both together."""
    decoding = getattr(app.state, "file_decoding", None)
    if decoding is None:
        decoding = app.state.file_decoding = asyncio.Semaphore(MAX_CONCURRENT_DECODES)  # binds to the loop on first use
    return decoding


async def decode_upload(data: bytes, ctx: ServerContext, decoding: asyncio.Semaphore) -> tuple[np.ndarray, float]:
    """(samples at the model's rate, duration in s); RequestError 413 past --max-stream-s or the
    decoding budget (from the header, before decoding), 400 for audio that cannot be used."""
    try:
        async with decoding:  # off the event loop: an hour of audio takes seconds to decode
            return await asyncio.to_thread(decode_file, data, ctx.model.geometry.sample_rate, ctx.settings.max_stream_s)
    except FileTooLong as e:
        raise RequestError(413, str(e), param="file", code="audio_too_long") from None
    except FileAudioError as e:
        raise RequestError(400, str(e), param="file", code="invalid_audio") from None


async def transcribe_samples(ctx: ServerContext, request: Request, samples: np.ndarray, duration_s: float,
                             language: str | None, context_right: int | None, diarization: dict | None,
                             **phrase_options) -> list[StreamResult]:  # fmt: skip
    """The file's finals through the engine as one stream; RequestError with the failure's status.
    `phrase_options`: phrases and boost (phrase boosting), where the route takes them."""
    job = FileTranscription(ctx, language, context_right, diarization, **phrase_options)
    try:
        return await job.run(samples, timeout_s=duration_s + TIMEOUT_MARGIN_S, receive=request.receive)
    except TranscriptionFailed as e:
        raise RequestError(e.status, e.reason, code=e.label) from None


def _options(form: FormData, query, ctx: ServerContext) -> dict:
    """The request's fields that mean something here, checked; 400 for a bad one."""
    model = ctx.model
    response_format = _field(form, "response_format") or "json"
    if response_format not in fmt.RESPONSE_FORMATS:
        raise RequestError(400, f"response_format {preview(response_format, 40)} is not one of "
                           f"{', '.join(fmt.RESPONSE_FORMATS)}", param="response_format")  # fmt: skip
    if (_field(form, "stream") or "false").lower() == "true":
        raise RequestError(400, "stream=true is not supported: the whole transcript comes in one response", param="stream")
    given_language = _field(form, "language")
    diarization = _diarization(form, response_format, model.num_speakers)
    languages = sorted(model.prompt_dictionary) if model.prompt_dictionary else None
    try:
        language = model_language(given_language, languages)
    except RealtimeError as e:
        raise RequestError(400, str(e), param="language") from None
    raw_mode = _field(form, "context_right") or query.get("context_right")
    return {
        "response_format": response_format,
        "language": language,
        "language_label": language or given_language or model.default_language or "unknown",
        "context_right": context_right_option(raw_mode, model.modes) if raw_mode else None,
        "diarization": diarization,
    }


def _diarization(form: FormData, response_format: str, num_speakers: int | None) -> dict | None:
    """The stream's diarization option: on for diarized_json (all the diarizer's speakers unless
    max_speakers says fewer) or split_on_speaker_change=true, else None. 400 before any decoding
    where it cannot be served."""
    known = [name for name in form if name.startswith("known_speaker_")]
    if known:
        raise RequestError(400, f"{known[0]} is not supported: speakers are labelled A, B, ... in order of "
                           "appearance, not matched to reference voices", param=known[0])  # fmt: skip
    split = _flag(form, "split_on_speaker_change")
    max_speakers = _field(form, "max_speakers")
    if response_format != "diarized_json" and not split:
        if max_speakers is not None:
            raise RequestError(400, "max_speakers needs response_format diarized_json or split_on_speaker_change "
                               "true (other formats show no speakers)", param="max_speakers")  # fmt: skip
        return None
    if num_speakers is None:
        param = "response_format" if response_format == "diarized_json" else "split_on_speaker_change"
        raise RequestError(400, f"{param} {_field(form, param) or 'diarized_json'}: this server has no diarizer "
                           "loaded (start it with --diarizer)", param=param)  # fmt: skip
    if max_speakers is not None and not (max_speakers.isdigit() and 1 <= int(max_speakers) <= num_speakers):
        raise RequestError(400, f"max_speakers {preview(max_speakers, 20)}: use a whole number from 1 to "
                           f"{num_speakers} (the diarizer's speakers)", param="max_speakers")  # fmt: skip
    return {"max_speakers": int(max_speakers) if max_speakers else num_speakers, "split_on_speaker_change": split}


def _flag(form: FormData, name: str) -> bool:
    """A true/false form field (absent: false); 400 for anything else."""
    value = (_field(form, name) or "false").lower()
    if value not in ("true", "false"):
        raise RequestError(400, f"{name} {preview(value, 20)}: use true or false", param=name)
    return value == "true"


def context_right_option(raw: str, served: tuple[int, ...]) -> int:
    """The latency mode asked for (protocol.mode_number: checked as text before int())."""
    mode = mode_number(raw.strip())
    if mode is None or mode not in served:
        raise RequestError(400, f"context_right {preview(raw, 20)} is not a latency mode served here; "
                           f"valid values: {', '.join(str(r) for r in served)}", param="context_right")  # fmt: skip
    return mode


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None or isinstance(value, UploadFile):
        return None
    if len(value) > MAX_FIELD_BYTES:
        raise RequestError(400, f"field '{name}' is longer than {MAX_FIELD_BYTES} characters", param=name)
    return value.strip()


def _render(finals, duration_s: float, options: dict) -> Response:
    kind = options["response_format"]
    if kind == "json":
        return JSONResponse(fmt.json_body(finals, duration_s))
    if kind == "diarized_json":
        return JSONResponse(fmt.diarized_body(finals, duration_s))
    if kind == "verbose_json":
        return JSONResponse(fmt.verbose_body(finals, duration_s, options["language_label"]))
    if kind == "text":
        return PlainTextResponse(fmt.transcript_text(finals) + "\n")
    media = "application/x-subrip" if kind == "srt" else "text/vtt"
    return PlainTextResponse(fmt.subtitles(finals, kind), media_type=media)


async def _read_form(request: Request, max_file_bytes: int) -> FormData:
    """The multipart form, its body capped at the file limit plus room for the other fields:
    refused from Content-Length before reading when it says more, else when the count passes it."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise RequestError(400, "the request must be multipart/form-data with the audio in a 'file' field")
    max_body = max_file_bytes + FORM_OVERHEAD_BYTES
    declared = request.headers.get("content-length", "")
    too_big = f"request body is over the server's limit of {max_file_bytes} bytes of audio (--max-file-bytes)"
    if declared.isdigit() and int(declared) > max_body:
        raise RequestError(413, too_big, param="file", code="file_too_large")
    parser = MultiPartParser(request.headers, _capped(request.stream(), max_body, too_big),
                             max_files=1, max_fields=MAX_FIELDS, max_part_size=MAX_FIELD_BYTES * 2)  # fmt: skip
    try:
        return await parser.parse()
    except MultiPartException as e:
        raise RequestError(400, f"malformed multipart form: {e.message}") from None
    except ClientDisconnect:  # the client left, or its body stopped past the deadline (408 sent)
        raise RequestError(499, "the client closed the connection before its upload was complete",
                           code="client_gone") from None  # fmt: skip


async def _capped(stream: AsyncIterator[bytes], max_bytes: int, too_big: str) -> AsyncIterator[bytes]:
    num_bytes = 0
    async for chunk in stream:
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise RequestError(413, too_big, param="file", code="file_too_large")
        yield chunk


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error body; 503 says when to retry, as /ws's refusals do."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {"Retry-After": "1"} if status == 503 else None
    if status == 401:
        headers = {"WWW-Authenticate": 'Bearer realm="nemo-serve"'}
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
