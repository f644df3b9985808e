"""The records of a result file, for the figures that must be backed together (issue 51, audit item 1).

page_figures.py matches a figure against any number of its files, which lets a wrong "3 / 8" pass
when a 3 and an 8 sit anywhere in the file. Here a file is cut into records, and

- a count `a / b` or `a of b` (a <= b, b > 0) is backed only when one record holds both numbers (two entries when
  a equals b), or a text of one record reads `a/b` or `a of b`, or a number of the files is a/b
  to three or more decimals (a rate the docs quote as a count);
- a small whole number with a unit (10 or less: "2 waits", "3 s", "8 streams") is backed only when
  one record holds it and another figure of its sentence: a lone small number is in nearly every
  file;
- a percentage is a fraction of the files times 100, rounded as written, or a number of a field
  named as a percentage (`_pct`, `percent`), or a relative change ((n - 1) x 100); not any number;
- in a sentence that names a level (`64 streams`: a number of the sentence that a record holds
  under a level's name), a figure must not be held only by records of other levels.

A record is one JSON object's own numbers and texts (with the numbers of the lists of numbers in
it), one list of numbers, the numbers of the `command` that made the file, or one line of a text file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?"
# The fields that name a run's load level (not a count that came out of it: `streams_refused`)
LEVEL_KEYS = {"streams", "num_streams", "clients", "concurrency", "level", "next_level", "streams_kept_up",
              "mixed_kept_up_streams", "split_kept_up_streams", "realtime_streams"}
PERCENT_KEY = re.compile(r"pct|percent|_%", re.I)
SMALL = 10


class Record:
    """One record's numbers (with the key each sits under) and texts."""

    def __init__(self) -> None:
        self.numbers: list[tuple[str, float]] = []
        self.texts: list[str] = []
        self.settings = False  # the numbers of the command that made the file
        self.levels: set[float] = set()  # its numbers under a level's name, and those of the objects it is in


def _numbers_in(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(NUMBER, text)]


def _walk(x, out: list[Record], levels: frozenset = frozenset()) -> None:
    """`levels`: those of the objects `x` is in (a run's breakdown belongs to its run's level)."""
    if isinstance(x, dict):
        rec = Record()
        for k, v in x.items():
            if isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                rec.numbers.append((k, float(v)))
            elif k == "command" and isinstance(v, str):  # the run's settings: a record of their own
                settings = Record()
                settings.numbers, settings.settings = [(k, n) for n in _numbers_in(v)], True
                out.append(settings)
            elif isinstance(v, str):
                rec.texts.append(v)
            elif isinstance(v, list) and v and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v):
                rec.numbers += [(k, float(e)) for e in v]
        rec.levels = set(levels) | {n for k, n in rec.numbers if k in LEVEL_KEYS}
        out.append(rec)
        for v in x.values():
            if isinstance(v, (dict, list)):
                _walk(v, out, frozenset(rec.levels))
    elif isinstance(x, list):
        if x and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in x):
            rec = Record()
            rec.numbers, rec.levels = [("", float(e)) for e in x], set(levels)
            out.append(rec)
        for v in x:
            if isinstance(v, (dict, list)):
                _walk(v, out, levels)


def records(path: Path) -> list[Record]:
    """The records of a result file (JSON, JSON lines, or text: a line each)."""
    out: list[Record] = []
    if path.suffix not in (".json", ".jsonl"):
        for line in path.read_text().splitlines():
            rec = Record()
            rec.numbers, rec.texts = [("", n) for n in _numbers_in(line)], [line]
            out.append(rec)
        return out
    for chunk in [path.read_text()] if path.suffix == ".json" else path.read_text().splitlines():
        if chunk.strip():
            _walk(json.loads(chunk), out)
    return out


def _count(rec: Record, value: float) -> int:
    return sum(1 for _, n in rec.numbers if n == value)


def is_count(a: float, b: float) -> bool:
    """Whether `a / b` can be a count of cases (k of n): k <= n, n > 0. '189 / 0' (ms before / after)
    is two figures side by side, each checked as a number."""
    return 0 <= a <= b and b > 0


def pair_backed(a: float, b: float, recs: list[Record]) -> bool:
    """Whether `a / b` (a count of cases) is held as a pair by one record, or as their ratio."""
    said = re.compile(rf"(?<![\d.]){a:g}\s?(?:/|of)\s?{b:g}(?![\d.])")
    for rec in recs:
        if (_count(rec, a) >= 2 if a == b else _count(rec, a) and _count(rec, b)) or any(said.search(t) for t in rec.texts):
            return True
    if not b or a in (0, b):
        return False  # a ratio of 0 or 1 is any 0 or 1 of the files
    return any(_ratio_matches(n, a / b) for rec in recs for _, n in rec.numbers)


def _ratio_matches(n: float, ratio: float) -> bool:
    text = repr(n)
    decimals = len(text.split(".")[1]) if "." in text and "e" not in text else 0
    return decimals >= 3 and abs(n - ratio) <= 0.5 * 10**-decimals + 1e-12


def is_small(value: float, decimals: int) -> bool:
    return decimals == 0 and abs(value) <= SMALL


def small_backed(value: float, unit: str, others: list[tuple[float, int, str]], recs: list[Record], held) -> bool:
    """Whether one record holds a small whole number together with another figure of its sentence
    (`others`: (value, decimals, unit); `held(value, decimals, unit, numbers)` says whether a list
    of numbers holds a figure, in its unit)."""
    for rec in recs:
        numbers = [n for _, n in rec.numbers]
        if rec.settings and value in numbers:
            return True  # a run's own flags (`--seconds 8`) state its settings, as written
        if not held(value, 0, unit, numbers) or rec.settings:
            continue
        if any(held(v, d, u, numbers) for v, d, u in others):
            return True
        if any(held(value, 0, unit, [n]) and _key_names_unit(k, unit) for k, n in rec.numbers):
            return True  # `audio_s_per_stream: 8.0` says what its 8 is
    return False


KEY_WORDS = {"time": {"s", "ms", "us", "seconds", "sec", "min", "minutes", "hours"},
             "bytes": {"bytes", "b", "kb", "mb", "mib", "gb", "gib", "kib"}}


def _key_names_unit(key: str, unit: str) -> bool:
    """Whether a field's name says the unit a figure is written in: `audio_s_per_stream` a time,
    `memory_bytes` a size, `streams` or `max_streams` a count of streams."""
    words = set(key.lower().split("_"))
    kind = {"µs": "time", "us": "time", "ms": "time", "s": "time", "min": "time", "minutes": "time",
            "seconds": "time", "hours": "time", "MB": "bytes", "MiB": "bytes", "GB": "bytes",
            "GiB": "bytes", "kB": "bytes", "KB": "bytes", "KiB": "bytes", "bytes": "bytes"}.get(unit)
    if kind:
        return bool(words & KEY_WORDS[kind])
    singular = unit.lower().rstrip("s")
    return bool(words & ({singular, singular + "s"} | ({"cpu", "cpus"} if singular == "core" else set())))


def percent_numbers(recs: list[Record]) -> tuple[list[float], list[float]]:
    """(every number, the numbers of fields named as percentages): the candidates a percentage is
    matched to as a fraction (x 100) or a relative change, and those taken as they are."""
    every = [n for rec in recs for _, n in rec.numbers]
    named = [n for rec in recs for k, n in rec.numbers if PERCENT_KEY.search(k)]
    return every, named


def level_backed(values: list[tuple[float, int]], unit: str, sentence: list[float], recs: list[Record], held) -> bool:
    """Whether a figure of a sentence that names a level ("kept up 64 streams (p95 439 ms)", "9.41
    us at 4,000 streams") is held by a record that is not of another level: each of its numbers
    ("15.14 / 15.48 to 8.86 / 9.62 us" may come from two runs) by a record of one of the sentence's
    levels (a record holding one of the sentence's numbers under a level's name, LEVEL_KEYS, or in
    an object that does), of no level (a summary, a target), or by the run's flags. A number held
    only by the records of levels the sentence does not name was copied from the wrong run. A
    sentence naming no level of the files ties it to nothing (the looser check)."""
    named = {v for v in sentence if any(v in rec.levels for rec in recs)}
    if not named:
        return True
    return all(any((rec.settings or not rec.levels or named & rec.levels) and held(v, d, unit, [n for _, n in rec.numbers])
                   for rec in recs) for v, d in values)  # fmt: skip
