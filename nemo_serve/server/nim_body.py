"""The NIM session POST's body, read and checked before any work is done on it.

Limits, each checked before the work it bounds:
  size     Content-Length over MAX_BODY_BYTES: 413 before a byte is read; without one (chunked),
           the count of bytes read so far: 413 as soon as it passes, the rest is never read
           (rejected: `await request.body()`, which buffered a 200 MB body before the check);
  nesting  a scan of the text counts bracket depth outside strings before json.loads, which
           recurses once per level (a 64 kB body of `[` raised RecursionError: a 500);
  numbers  integers of more than MAX_INT_DIGITS digits are refused while parsing (Python's own
           limit, 4,300 digits, answers with an internal text).
Each refusal is a 400 (413 for size) that says what was wrong in the client's terms; a body that
stops coming is cut by the connection's request deadline (--header-timeout-s, HTTP 408), and
the disconnect it leaves the handler with is a refusal, not a traceback.
"""

from __future__ import annotations

import json
import re

from fastapi import Request
from starlette.requests import ClientDisconnect

from .logsafe import preview

MAX_BODY_BYTES = 64 * 1024
MAX_NESTING = 32  # NIM's session is 3 levels deep; room for extensions
MAX_INT_DIGITS = 100
# A string (its closing quote optional, so an unterminated one is consumed once, not rescanned
# from each quote inside it: linear time) or a bracket.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[{\]}]', re.DOTALL)
_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII only: str.isdigit() takes "²"
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}  # fmt: skip


class BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_capped(request: Request) -> bytes:
    """The body, read no further than MAX_BODY_BYTES."""
    too_big = f"session body is over {MAX_BODY_BYTES} bytes"
    declared = request.headers.get("content-length")
    if declared is not None:
        if not _DIGITS.fullmatch(declared):
            raise BodyError(400, f"Content-Length must be a number of bytes, not {preview(declared)}")
        if int(declared) > MAX_BODY_BYTES:
            raise BodyError(413, too_big)
    chunks, num_bytes = [], 0
    try:
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > MAX_BODY_BYTES:
                raise BodyError(413, too_big)
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut by the request deadline (408): nobody reads this answer
        raise BodyError(400, "the connection closed before the body was complete") from None
    return b"".join(chunks)


def parse_object(body: bytes) -> dict | None:
    """The body as a JSON object; None when empty."""
    if not body.strip():
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the body is not UTF-8 (byte {e.start})") from None
    depth = nesting_depth(text)
    if depth > MAX_NESTING:
        raise BodyError(400, f"the body nests arrays and objects more than {MAX_NESTING} levels deep")
    try:
        value = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as e:
        raise BodyError(400, f"the body is not valid JSON: {e.msg} at character {e.pos}") from None
    except ValueError as e:  # _bounded_int
        raise BodyError(400, str(e)) from None
    if not isinstance(value, dict):
        raise BodyError(400, f"the body must be a JSON object (or empty), not {_JSON_TYPES.get(type(value), 'that')}")
    return value


def nesting_depth(text: str, stop_at: int = MAX_NESTING) -> int:
    """How deep brackets nest outside strings (stops counting once past `stop_at`)."""
    depth = deepest = 0
    for m in _TOKENS.finditer(text):
        c = text[m.start()]
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_at:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"a number in the body has {len(digits)} digits; at most {MAX_INT_DIGITS} are allowed")
    return int(digits)
