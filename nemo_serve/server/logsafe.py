"""What a client sends never reaches the log, or an error reply, whole, raw or secret.

`preview(value)` is how client input appears in a reason: escaped (`ascii()`, so no control
characters, terminal escapes or lone surrogates), cut to a few dozen characters.

`SafeLogFilter` sits on every log handler (ours and uvicorn's) and, per record:
  - redacts `token=...` in query strings (uvicorn's access lines print the request path),
    minted client secrets (`ek_...`, by their shape) and every configured secret, wherever
    they appear;
  - escapes control characters (a newline in a request path cannot forge a log line) and cuts
    the line to MAX_LINE_CHARS, a traceback to MAX_TRACEBACK_CHARS;
  - rate-limits: each kind of line (logger + message template) gets a bucket of BURST lines
    refilled at RATE_PER_S; what it drops is counted and said on the next line of that kind.
A filter on the handlers, not on the loggers: records propagate to handlers without passing
their ancestors' logger filters, so a logger filter would miss children such as
`nemo_serve.session`. Rejected: a logging.Formatter subclass (uvicorn installs its own).
"""

from __future__ import annotations

import logging
import re
import threading
import time

MAX_LINE_CHARS = 1000
MAX_ARG_CHARS = 300  # each argument of an access line (the request path)
MAX_TRACEBACK_CHARS = 6000
BURST = 20  # lines of one kind logged back to back before the rate limit starts
RATE_PER_S = 2.0  # then this many per second
MAX_KINDS = 512  # distinct buckets kept; beyond, every new kind shares one bucket
_QUERY_SECRET = re.compile(r"(?i)(token=)[^&\s\"']*")
# A client secret minted by POST /v1/realtime/transcription_sessions (auth.py: ek_EXPIRY_NONCE_MAC),
# wherever it travels: the Authorization header, `realtime-token.` in Sec-WebSocket-Protocol, the
# POST's answer. Redacted by its shape: the secrets are stateless, there is no list of them to match.
_CLIENT_SECRET = re.compile(r"ek_[0-9A-Za-z]+_[0-9A-Za-z]+_[0-9A-Za-z]+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# uvicorn logs these at ERROR with a traceback, once per offending frame.
_CLIENT_CAUSED = {"Invalid UTF-8 sequence received from client.": "client sent invalid UTF-8 in a text frame (closed 1007)"}


def preview(value: object, max_chars: int = 40) -> str:
    """A short, escaped rendering of client input for a reason or a log line."""
    text = ascii(value)
    return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text)} chars)"


def clean(text: str, max_chars: int = 60) -> str:
    """Client text kept as is when short and printable ASCII (a field name), else escaped and cut."""
    if len(text) <= max_chars and text.isascii() and text.isprintable():
        return text
    escaped = ascii(text)[1:-1]
    return escaped if len(escaped) <= max_chars else f"{escaped[:max_chars]}... ({len(text)} chars)"


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    text = _QUERY_SECRET.sub(r"\1<redacted>", text)
    text = _CLIENT_SECRET.sub("ek_<redacted>", text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def _escape(text: str, keep_newlines: bool) -> str:
    if not keep_newlines:
        text = text.replace("\n", "\\n").replace("\r", "\\r")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else f"{text[:max_chars]}... [{len(text) - max_chars} chars cut]"


class SafeLogFilter(logging.Filter):
    def __init__(self, secrets: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)
        self._lock = threading.Lock()  # the step loop thread logs too
        self._buckets: dict[tuple[str, str], list[float]] = {}  # kind -> [tokens, last time, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_nemo_serve_safe", False):  # already made safe (a second handler)
            return True
        if record.msg in _CLIENT_CAUSED:  # the client's fault: one line, no traceback
            record.msg, record.args, record.exc_info, record.exc_text = _CLIENT_CAUSED[record.msg], None, None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        dropped = self._take(record)
        if dropped is None:
            return False
        if record.name == "uvicorn.access" and isinstance(record.args, tuple):
            # uvicorn's access formatter reads the five args (client, method, path, version,
            # status) again: make each safe instead of flattening the line.
            record.args = tuple(self._safe(a, MAX_ARG_CHARS) if isinstance(a, str) else a for a in record.args)
            if dropped:
                record.msg = f"{record.msg} [{dropped} similar lines suppressed]"
        else:
            msg = self._safe(record.getMessage(), MAX_LINE_CHARS)
            record.msg, record.args = msg + (f" [{dropped} similar lines suppressed]" if dropped else ""), None
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = _cut(_escape(redact(text, self.secrets), keep_newlines=True), MAX_TRACEBACK_CHARS)
        record._nemo_serve_safe = True
        return True

    def _safe(self, text: str, max_chars: int) -> str:
        return _cut(_escape(redact(text, self.secrets), keep_newlines=False), max_chars)

    def _take(self, record: logging.LogRecord) -> int | None:
        """Lines dropped since the last one of this kind, or None to drop this one too."""
        kind = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.get(kind)
            if bucket is None:
                if len(self._buckets) >= MAX_KINDS:
                    kind = ("", "")
                bucket = self._buckets.setdefault(kind, [float(BURST), now, 0])
            bucket[0] = min(float(BURST), bucket[0] + (now - bucket[1]) * RATE_PER_S)
            bucket[1] = now
            if bucket[0] < 1.0:
                bucket[2] += 1
                return None
            bucket[0] -= 1.0
            dropped, bucket[2] = int(bucket[2]), 0
            return dropped


def install(secrets: tuple[str, ...] = (), logger_names: tuple[str, ...] = ("", "uvicorn", "uvicorn.access")) -> SafeLogFilter:
    """Put one filter on every handler of these loggers (root, and uvicorn's two, after uvicorn
    has configured them)."""
    f = SafeLogFilter(secrets)
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            for old in [x for x in handler.filters if isinstance(x, SafeLogFilter)]:
                handler.removeFilter(old)
            handler.addFilter(f)
    return f
