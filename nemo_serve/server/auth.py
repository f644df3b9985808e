"""Who may use the server: the bearer token, and the short-lived client secrets minted from it.

  bearer token   `Authorization: Bearer TOKEN` (or `Token TOKEN`, Deepgram's clients; or
                 `?token=TOKEN`, for browsers: JavaScript cannot set WebSocket headers) on every
                 route that takes audio; compared in constant time.
  client secret  what `POST /v1/realtime/transcription_sessions` hands out (nim_sessions.py) to a
                 caller that presented the token: a secret that opens one /v1/realtime socket
                 within CLIENT_SECRET_TTL_S, so the long-lived token need not travel to the
                 client that streams. NVIDIA's realtime client offers it as a WebSocket
                 subprotocol (`realtime-token.SECRET`, beside `realtime`); OpenAI's browser flow
                 sends it as the bearer token.

A secret is stateless: `ek_EXPIRY_NONCE_MAC`, the MAC an HMAC-SHA256 of expiry and nonce under the
server's token. Any front-end process can check it (they share the token, not memory), and a
restart with another token voids every secret. Rejected: a table of minted secrets, which a
POST to one front end and a WebSocket to another (--frontends K share one port) would miss. What
the table would give, single use, is not promised: a secret may open several sockets until it
expires, as OpenAI's ephemeral keys do.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from starlette.requests import HTTPConnection

CLIENT_SECRET_TTL_S = 60  # OpenAI's ephemeral keys live one minute too: long enough to connect
SECRET_PREFIX = "ek_"
SUBPROTOCOL = "realtime"  # what NVIDIA's client offers beside its token, and gets back
TOKEN_SUBPROTOCOL_PREFIX = "realtime-token."
MAX_EXPIRY_DIGITS = 12  # a Unix time in seconds has 10 until the year 2286


def given_token(conn: HTTPConnection) -> str:
    """The bearer token the request carries (header, else `?token=`), or "". The header's scheme
    is `Bearer`, or `Token`: what Deepgram's clients send their key with (its SDK, pipecat's and
    livekit's Deepgram plugins), so that they reach /v1/listen unchanged."""
    scheme, _, value = conn.headers.get("authorization", "").partition(" ")
    if scheme.lower() in ("bearer", "token"):
        return value.strip()
    return conn.query_params.get("token", "")


def authorized(conn: HTTPConnection, token: str | None) -> bool:
    """The server's token, or no token configured."""
    if token is None:
        return True
    return hmac.compare_digest(given_token(conn).encode(), token.encode())


def mint_client_secret(token: str, now: float | None = None) -> tuple[str, int]:
    """(secret, expires_at in Unix seconds)."""
    expires_at = int(now if now is not None else time.time()) + CLIENT_SECRET_TTL_S
    nonce = secrets.token_hex(8)
    return f"{SECRET_PREFIX}{expires_at}_{nonce}_{_mac(token, expires_at, nonce)}", expires_at


def valid_client_secret(secret: str, token: str, now: float | None = None) -> bool:
    """Minted under `token` and not expired."""
    parts = secret.removeprefix(SECRET_PREFIX).split("_")
    if not secret.startswith(SECRET_PREFIX) or len(parts) != 3 or not _is_expiry(parts[0]):
        return False
    expires_at, nonce, mac = int(parts[0]), parts[1], parts[2]
    if (now if now is not None else time.time()) > expires_at:
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, expires_at, nonce).encode())


def _is_expiry(text: str) -> bool:
    """What mint_client_secret writes: ASCII digits, no more than a Unix time has. Checked before
    int(): str.isdigit() is true for Unicode digits such as '\\xb2', which int() refuses, and int()
    refuses more than 4,300 digits; either raised out of the handshake as a 500."""
    return 0 < len(text) <= MAX_EXPIRY_DIGITS and text.isascii() and text.isdigit()


def offered_subprotocols(conn: HTTPConnection) -> list[str]:
    raw = conn.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def realtime_authorized(conn: HTTPConnection, token: str | None) -> bool:
    """/v1/realtime: the token, or a client secret as the bearer token or as a subprotocol."""
    if authorized(conn, token):
        return True
    candidates = [given_token(conn)] + [
        p[len(TOKEN_SUBPROTOCOL_PREFIX):] for p in offered_subprotocols(conn) if p.startswith(TOKEN_SUBPROTOCOL_PREFIX)
    ]
    return any(valid_client_secret(c, token) for c in candidates if c)


def accepted_subprotocol(conn: HTTPConnection) -> str | None:
    """The subprotocol to answer with: `realtime` where offered (never the token entry, so the
    secret does not come back in the response headers), else none."""
    return SUBPROTOCOL if SUBPROTOCOL in offered_subprotocols(conn) else None


def _mac(token: str, expires_at: int, nonce: str) -> str:
    message = f"{expires_at}.{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()[:32]
