"""POST /v1/listen: Deepgram's pre-recorded transcription, on /v1/audio/transcriptions' machinery.

What its clients send, unchanged (deepgram-sdk's `listen.v1.media.transcribe_file`, pipecat's
file path; livekit-plugins-deepgram's `STT.recognize()`): the audio file's bytes as the body
(Content-Type application/octet-stream or audio/*), options as query parameters, the key as
`Authorization: Token KEY`. What they parse: metadata{request_id, sha256, created, duration,
channels, models, model_info} and results.channels[0].alternatives[0]{transcript, confidence,
words[{word, start, end, confidence, punctuated_word}]}, results.utterances with utterances=true.

  language        as /v1/audio/transcriptions' (a prompt model's prompt; a hint otherwise)
  utterances      true: results.utterances, one per engine segment (the endpointer splits at
                  pauses; utt_split is not used), each with its token ids (nemo-serve's extension)
  diarize         true: a speaker per word and per utterance (a --diarizer server; 400 without)
  context_right   nemo-serve's: the latency mode, as /ws takes it
  keywords, keyterm  phrase boosting, as /ws's `phrases` and `boost` (deepgram_keywords.py)
  refused (400), given any value but `false`: features that add output or a promise this
                  server does not keep (REFUSED):
                  remote audio (a JSON body {"url": ...}: this server fetches nothing), callback,
                  summaries, topics, intents, sentiment, entities, search, redaction,
                  replacement, paragraphs, multichannel, profanity filtering
  accepted, ignored: the rest (model, punctuate, smart_format, numerals, ...):
                  one model, whose output is what it is; unknown ones too (a newer SDK's)

Order of checks, cheapest first, as /v1/audio/transcriptions': Origin (403), token (401),
admission (503), parameters (400), Content-Type (400 for JSON), body size (413 from
Content-Length before reading, or while reading; 408 if it stops coming, 499 if the client
leaves), audio (transcriptions.decode_upload: 400, or 413 from the header before decoding),
the slot (503). Errors are Deepgram's shape, {"err_code", "err_msg", "request_id"}; every answer
carries the request id in `dg-request-id`, as Deepgram's do.
"""

from __future__ import annotations

import asyncio
import hashlib
import string
import uuid
from collections.abc import Callable
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from ..engine.results import StreamResult
from .auth import authorized
from .context import Refused, ServerContext
from .deepgram_keywords import keyword_phrases
from .deepgram_live import SERVER_VERSION  # model_info's version: the server's (one model, as loaded)
from .logsafe import preview
from .realtime_protocol import RealtimeError, model_language
from .transcriptions import RequestError, context_right_option, decode_upload, file_decoding, transcribe_samples

# Parameter -> why it is refused when given (a flag: when true). Silently dropping these would
# hand the client a response without what it asked for, or break a promise (redaction).
REFUSED = {
    "callback": "callbacks are not supported: the transcript comes in the response",
    "summarize": "summaries are not supported", "topics": "topic detection is not supported",
    "custom_topic": "topic detection is not supported", "intents": "intent recognition is not supported",
    "custom_intent": "intent recognition is not supported", "sentiment": "sentiment analysis is not supported",
    "detect_entities": "entity detection is not supported", "search": "search is not supported",
    "redact": "redaction is not supported: the transcript would carry what was to be redacted",
    "replace": "term replacement is not supported", "paragraphs": "paragraphs are not supported",
    "multichannel": "multichannel is not supported: channels are averaged into one",
    "profanity_filter": "profanity filtering is not supported",
}  # fmt: skip
FLAGS = {"sentiment", "topics", "intents", "detect_entities", "paragraphs", "multichannel", "profanity_filter"}
ERR_CODES = {400: "Bad Request", 401: "INVALID_AUTH", 403: "Forbidden", 413: "Payload Too Large",
             499: "Client Closed Request", 500: "Internal Server Error", 503: "Service Unavailable"}  # fmt: skip
ARCH = "nemo-cache-aware-streaming"
_WORD_EDGES = string.punctuation.replace("'", "") + "¿¡«»“”„"  # what Deepgram's `word` drops at its ends


def add_prerecorded_routes(app: FastAPI, ctx: ServerContext, origin_refusal: Callable[[Request], str | None]) -> None:
    """`origin_refusal`: app.py's Origin rule (a page may POST cross-origin without a preflight)."""
    decoding = file_decoding(app)  # shared with /v1/audio/transcriptions: one decoding budget

    @app.post("/v1/listen")
    async def listen(request: Request) -> Response:
        request_id = str(uuid.uuid4())
        try:
            bad_origin = origin_refusal(request)
            if bad_origin is not None:
                ctx.metrics.refusals.labels(reason="origin").inc()
                raise RequestError(403, bad_origin)
            body = await _transcribe(request, ctx, decoding, request_id)
        except RequestError as e:
            ctx.metrics.file_transcriptions.labels(status=str(e.status)).inc()
            return error_response(e.status, e.message, request_id)
        ctx.metrics.file_transcriptions.labels(status="200").inc()
        return JSONResponse(body, headers={"dg-request-id": request_id})


async def _transcribe(request: Request, ctx: ServerContext, decoding: asyncio.Semaphore, request_id: str) -> dict:
    if not authorized(request, ctx.settings.auth_token):
        ctx.metrics.refusals.labels(reason="unauthorized").inc()
        raise RequestError(401, "missing or wrong API key (Authorization: Token KEY)")
    try:
        ctx.admit()  # early, before the body is read; the job takes its slot with admit() again
    except Refused as e:
        raise RequestError(503, e.reason) from None
    options = _options(request.query_params, ctx)
    if request.headers.get("content-type", "").lower().startswith("application/json"):
        raise RequestError(400, "a JSON body (remote audio by URL) is not supported: this server fetches nothing; "
                           "send the audio file's bytes as the body (Content-Type audio/* or application/octet-stream)")  # fmt: skip
    data = await _read_body(request, ctx.settings.max_file_bytes)
    samples, duration_s = await decode_upload(data, ctx, decoding)
    finals = await transcribe_samples(ctx, request, samples, duration_s, options["language"], options["context_right"],
                                      options["diarization"], phrases=options["phrases"], boost=options["boost"])  # fmt: skip
    about = {"request_id": request_id, "sha256": hashlib.sha256(data).hexdigest(), "duration": duration_s,
             "model": ctx.model.name, "tags": options["tags"]}  # fmt: skip
    return response_body(finals, about, utterances=options["utterances"])


def _options(query, ctx: ServerContext) -> dict:
    """The parameters that mean something here, checked; 400 for a refused or bad one."""
    for name, why in REFUSED.items():
        asked = _flag(query, name) if name in FLAGS else any(v.strip().lower() != "false" for v in query.getlist(name))
        if asked:  # `false` asks for nothing (summarize=false), so it passes
            raise RequestError(400, f"{name}: {why} (nemo-serve speaks Deepgram's transcript, words and utterances)")
    model = ctx.model
    diarize = _flag(query, "diarize")
    if diarize and model.num_speakers is None:
        raise RequestError(400, "diarize=true: this server has no diarizer loaded (start it with --diarizer)")
    languages = sorted(model.prompt_dictionary) if model.prompt_dictionary else None
    try:
        language = model_language(query.get("language"), languages)
    except RealtimeError as e:
        raise RequestError(400, str(e)) from None
    raw_mode = query.get("context_right")
    try:
        boosting = keyword_phrases(query, ctx.settings.phrase_limits, model.vocabulary, model.is_bpe)
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    return {
        "phrases": list(boosting.phrases) if boosting else None,
        "boost": boosting.boost if boosting else None,
        "language": language,
        "context_right": context_right_option(raw_mode, model.modes) if raw_mode else None,
        "diarization": {"max_speakers": model.num_speakers, "split_on_speaker_change": False} if diarize else None,
        "utterances": _flag(query, "utterances"),
        "tags": query.getlist("tag"),
    }


def _flag(query, name: str) -> bool:
    """A true/false parameter (absent: false); 400 for anything else."""
    value = query.get(name, "false").strip().lower()
    if value not in ("true", "false"):
        raise RequestError(400, f"{name} {preview(value, 20)}: use true or false")
    return value == "true"


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused (413) from Content-Length before reading when it says more than
    --max-file-bytes, else as soon as the count passes it."""
    too_big = f"request body is over the server's limit of {max_bytes} bytes of audio (--max-file-bytes)"
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(413, too_big)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise RequestError(413, too_big)
    except ClientDisconnect:  # the client left, or its body stopped past the deadline (408 sent)
        raise RequestError(499, "the client closed the connection before its upload was complete") from None
    return bytes(body)


# ----------------------------------------------------------------------------- the response


def response_body(finals: list[StreamResult], about: dict, utterances: bool) -> dict:
    """Deepgram's ListenV1Response for one channel and one alternative. `about`: request_id,
    sha256 (of the body), duration (s), model (the served model's name), tags (echoed)."""
    model_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "nemo-serve/" + about["model"]))
    metadata = {
        "transaction_key": "deprecated", "request_id": about["request_id"], "sha256": about["sha256"],
        "created": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "duration": about["duration"], "channels": 1, "models": [model_id],
        "model_info": {model_id: {"name": about["model"], "version": SERVER_VERSION, "arch": ARCH}},
    }  # fmt: skip
    if about["tags"]:
        metadata["tags"] = about["tags"]
    words = [w for f in finals for w in _words(f)]
    alternative = {"transcript": " ".join(f.text for f in finals if f.text), "confidence": _confidence(words),
                   "words": words}  # fmt: skip
    results: dict = {"channels": [{"alternatives": [alternative]}]}
    if utterances:
        results["utterances"] = [u for f in finals for u in _utterances(f)]
    return {"metadata": metadata, "results": results}


def _words(f: StreamResult) -> list[dict]:
    """The final's words: `punctuated_word` as the model wrote it, `word` lowercased without the
    punctuation at its ends (Deepgram's pair); a confidence of 1.0 where none was computed (no
    --word-confidence), as Riva's mapping does; `speaker` on a diarized stream."""
    out = []
    for i, w in enumerate(f.words or ()):
        word = {"word": w.word.strip(_WORD_EDGES).lower() or w.word.lower(), "start": w.start, "end": w.end,
                "confidence": w.confidence if w.confidence is not None else 1.0, "punctuated_word": w.word}  # fmt: skip
        if f.word_speakers:
            word["speaker"] = f.word_speakers[i]
        out.append(word)
    return out


def _confidence(words: list[dict]) -> float:
    """The lowest word's (riva_mapping.py's rule: a transcript is as sure as its least sure word)."""
    return min((w["confidence"] for w in words), default=1.0)


def _utterances(f: StreamResult) -> list[dict]:
    """One utterance per engine segment with words, with its token ids (nemo-serve's extension);
    on a diarized stream, one per run of one speaker's words within it (without token ids: a
    token's word is not kept)."""
    words = _words(f)
    if not words:
        return []
    runs = [words]
    if f.word_speakers:
        runs = []
        for w in words:
            if runs and runs[-1][-1]["speaker"] == w["speaker"]:
                runs[-1].append(w)
            else:
                runs.append([w])
    out = []
    for run in runs:
        u = {"start": run[0]["start"], "end": max(run[0]["start"], run[-1]["end"]), "confidence": _confidence(run),
             "channel": 0, "transcript": " ".join(w["punctuated_word"] for w in run), "words": run,
             "id": str(uuid.uuid4())}  # fmt: skip
        if f.word_speakers:
            u["speaker"] = run[0]["speaker"]
        else:
            u["transcript"], u["token_ids"] = f.text, list(f.token_ids)
        out.append(u)
    return out


def error_response(status: int, message: str, request_id: str) -> JSONResponse:
    """Deepgram's error body; 503 says when to retry, as the other routes' refusals do."""
    headers = {"dg-request-id": request_id}
    if status == 503:
        headers["Retry-After"] = "1"
    if status == 401:
        headers["WWW-Authenticate"] = 'Token realm="nemo-serve"'
    body = {"err_code": ERR_CODES.get(status, "Error"), "err_msg": message, "request_id": request_id}
    return JSONResponse(body, status_code=status, headers=headers)
