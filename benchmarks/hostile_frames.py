"""Hostile WebSocket frames for fuzz_server.py: one connection's worth of random JSON for every
config field, wrong types, 5,000-digit integers, deep nesting, half-megabyte strings, invalid
UTF-8, odd-sized and NaN audio, frames out of order and oversized frames, from a seeded
`random.Random`, so a run is repeatable."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

import numpy as np

_HUGE = "@huge-int:"  # stands for an integer of that many digits (Python cannot even print one)
_HUGE_RE = re.compile(r'"' + _HUGE + r'(\d+)"')
_CFG_FIELDS = ("id", "sample_rate", "encoding", "interim_results", "endpointing", "language")


@dataclass(frozen=True)
class RawText:
    """Bytes sent in a text frame (so they may be invalid UTF-8)."""

    data: bytes


def _dumps(obj) -> str:
    return _HUGE_RE.sub(lambda m: "9" * int(m.group(1)), json.dumps(obj))


def _string(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return "".join(rng.choice("abcdefé€\u202e\x00\x1b\n\"'\\<>") for _ in range(rng.randrange(0, 40)))
    if kind == 1:
        return "A" * rng.choices((200, 5000, 70_000, 600_000), (8, 4, 2, 1))[0]  # would flood a log if echoed
    if kind == 2:
        return rng.choice(("config", "end", "force_final", "Done", "CONFIG", "config ", "partial", ""))
    if kind == 3:
        return "é" * rng.randrange(50, 300)  # two bytes each: close reasons must be cut by bytes
    if kind == 4:
        return "".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(rng.randrange(1, 30)))
    return "\ud800" + "x"  # a lone surrogate (json.dumps escapes it; the server must refuse it)


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(11 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice((0, -1, 1, 7999, 8000, 16000, 192001, 2**31, -(2**63), 2**64))
    if kind == 3:
        return f"{_HUGE}{rng.choice((4301, 5000, 20_000))}"  # past Python's int-from-string limit
    if kind == 4:
        return rng.choice((0.5, -0.0, 1e308, -1e-308, 16000.0, 3.5e38))
    if kind in (5, 6, 7):
        return _string(rng)
    if kind == 8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {_string(rng)[:50]: _value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _config(rng: random.Random) -> dict:
    cfg: dict = {"type": "config"}
    for name in rng.sample(_CFG_FIELDS, rng.randrange(0, len(_CFG_FIELDS) + 1)):
        cfg[name] = _value(rng)
    if rng.random() < 0.2:
        cfg[_string(rng)[:2000] or "x"] = _value(rng)  # an unknown field, its name echoed in the reason
    if rng.random() < 0.3:
        cfg["endpointing"] = {k: _value(rng) for k in ("enabled", "rule1_min_trailing_silence_s", _string(rng)[:40])}
    return cfg


def _audio(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    n = rng.randrange(0, 8000)
    if kind == 0:
        return rng.randbytes(n)  # random bytes: odd sizes, NaN and Inf patterns as float32
    if kind == 1:
        x = np.zeros(max(1, n // 4), "<f4")
        x[rng.randrange(len(x))] = rng.choice((np.nan, np.inf, -np.inf))
        return x.tobytes()
    if kind == 2:
        return b""
    if kind == 3:
        return np.full(max(1, n // 4), rng.choice((3.4e38, -1.0, 1.0, 1e-45)), "<f4").tobytes()
    return np.random.default_rng(rng.randrange(1 << 30)).normal(0, 0.1, n // 4).astype("<f4").tobytes()


def _text(rng: random.Random, max_message_bytes: int):
    kind = rng.randrange(12)
    if kind == 0:
        return _dumps({"type": _value(rng)})
    if kind == 1:
        return rng.choice(("Done", " Done\n", "done", '{"type": "end"}', '{"type": "force_final"}'))
    if kind == 2:
        return "[" * rng.choice((100, 10_000, 100_000))  # deep nesting
    if kind == 3:
        return "9" * rng.choice((4301, 10_000))  # a bare huge integer
    if kind == 4:
        return RawText(rng.choice((b"\xff\xfe", b'{"type": "\xc3"}', b"\xed\xa0\x80", rng.randbytes(64))))
    if kind == 5:
        return _string(rng)
    if kind == 6:
        return _dumps(_value(rng))
    if kind == 7 and rng.random() < 0.1:
        return "x" * (max_message_bytes + 1)  # over the limit: the transport closes with 1009
    return _dumps(_config(rng))


def hostile_case(rng: random.Random, max_message_bytes: int = 1 << 20) -> list:
    """The frames of one connection: up to six hostile text or binary frames, in any order."""
    frames: list = []
    if rng.random() < 0.5:
        frames.append(_dumps(_config(rng)) if rng.random() < 0.7 else _dumps({"type": "config"}))
    for _ in range(rng.randrange(1, 6)):
        frames.append(_audio(rng) if rng.random() < 0.4 else _text(rng, max_message_bytes))
    return frames


def case_size(frame) -> int:
    return len(frame.data) if isinstance(frame, RawText) else len(frame)
