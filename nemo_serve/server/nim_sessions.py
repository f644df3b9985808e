"""POST /v1/realtime/transcription_sessions: NVIDIA NIM's (and OpenAI's beta) session bootstrap.

NVIDIA's realtime client (`riva.client.realtime.RealtimeClientASR`, nvidia-riva-client 2.27)
posts `{}` here first, keeps the answer as the session's defaults, then opens
`/v1/realtime?intent=transcription`, offering the answer's `client_secret.value` as the
subprotocol `realtime-token.SECRET` when there is one, and sends the whole answer back, with its
overrides, as its `transcription_session.update`. So the answer is the session /v1/realtime
would start with, in NIM's documented shape (the beta transcription session plus
`input_audio_params`, `recognition_config`, `endpointing_config` and the rest), every field of
which /v1/realtime accepts back (realtime_protocol.py ignores those it does not use).

Auth: with a server token, the POST needs it (`Authorization: Bearer` or NIM's `X-API-Key`;
401 with `WWW-Authenticate` otherwise), and the answer carries a client secret that opens one
/v1/realtime socket within a minute (auth.py); without one, `client_secret` is null, which NIM's
client takes as "connect without a secret". The body may be empty or a JSON object (size, nesting
and numbers bounded before they cost anything: nim_body.py); its fields are
not kept: the socket is configured by its own update (rejected: carrying the POST's session into
the socket inside the secret, which no client we know of relies on).
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .auth import authorized, mint_client_secret
from .context import ServerContext
from .nim_body import BodyError, parse_object, read_capped
from .realtime_protocol import new_id
from .transcriptions import error_response


def add_nim_session_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/realtime/transcription_sessions")
    async def transcription_sessions(request: Request) -> Response:
        token = ctx.settings.auth_token
        if not (authorized(request, token) or _api_key_ok(request, token)):
            ctx.metrics.refusals.labels(reason="unauthorized").inc()
            return error_response(401, "missing or wrong API key (Authorization: Bearer, or X-API-Key)",
                                  code="invalid_api_key")  # fmt: skip
        try:
            parse_object(await read_capped(request))  # checked, not kept (the docstring says why)
        except BodyError as e:
            return error_response(e.status, str(e))
        return JSONResponse(default_session(ctx))


def default_session(ctx: ServerContext) -> dict:
    """The session a new /v1/realtime socket starts with, as NIM documents its answer."""
    model, settings = ctx.model, ctx.settings
    rules = settings.endpoint_config
    secret = None
    if settings.auth_token is not None:
        value, expires_at = mint_client_secret(settings.auth_token)
        secret = {"value": value, "expires_at": expires_at}
    turn_detection = None
    if rules.enabled:
        turn_detection = {"type": "server_vad", "silence_duration_ms": int(rules.rule2_min_trailing_silence_s * 1000)}
    return {
        "id": new_id("sess"),
        "object": "realtime.transcription_session",
        "modalities": ["text"],
        "input_audio_format": "pcm16",
        "input_audio_transcription": {"language": model.default_language or "en-US", "model": model.name, "prompt": ""},
        "input_audio_params": {"sample_rate_hz": model.geometry.sample_rate, "num_channels": 1},
        "recognition_config": {
            "max_alternatives": 1,
            "enable_automatic_punctuation": False,
            "enable_word_time_offsets": True,
            "enable_profanity_filter": False,
            "enable_verbatim_transcripts": True,
        },
        "speaker_diarization": {"enable_speaker_diarization": False, "max_speaker_count": 0},
        "word_boosting": {"enable_word_boosting": False, "word_boosting_list": []},
        "endpointing_config": {"start_history": 0, "start_threshold": 0, "stop_history": 0, "stop_threshold": 0,
                               "stop_history_eou": 0, "stop_threshold_eou": 0},  # fmt: skip
        "turn_detection": turn_detection,
        "client_secret": secret,
    }


def _api_key_ok(request: Request, token: str | None) -> bool:
    """NIM also takes the key as `X-API-Key`."""
    given = request.headers.get("x-api-key", "")
    return token is not None and bool(given) and hmac.compare_digest(given.encode(), token.encode())
