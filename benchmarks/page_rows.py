"""A hand-written table row's figures resolve against one record (issue 51).

page_figures.py checks each figure of a row on its own, against any number of the row's files, so a
row could take its p50 from the 64-stream run and its p95 from the 128-stream run and pass. Here
the figures of one row (those with a unit and the bare numbers of its cells; not counts `k / n`,
nor differences in points, which have their own rules) must all be held by ONE record:

- a record is a path from a file's root down through its lists of objects: the numbers of each
  object along it (its own fields, nested objects, lists of numbers, the run's `command`), never
  those of two elements of one list (two runs, two levels, two trees, two rows). A JSON lines file
  is a list of its lines; a text file's record is one line.

A table whose rows are meant to span records says so on its figures mark, naming what a row spans:

    <!-- figures: a.json b.json span:files -->   one record of each file (a row's columns: files)
    <!-- figures: a.json span:tree -->           one record per value of the field `tree`
    <!-- figures: a.json span:trees -->          one record under each element of every `trees` list

and the records a row takes must still be of one thing: no load level (LEVEL_KEYS), setting
(IDENTITY_KEYS: `chunk_ms`, `batch`, ...) or label (a text field below the file's own run fields)
with two values, but what is spanned. A field is the tighter span: the elements of a spanned list
may differ in their labels and settings; the objects holding a spanned field, in their labels only.
Whatever a row does not declare it spans, it takes from one record; a row that mixes is named.
"""

from __future__ import annotations

import json
import math
import re
from itertools import product
from pathlib import Path

from benchmarks.performance_page_records import LEVEL_KEYS, NUMBER, PERCENT_KEY

SPAN = "span:"
ROW_RULES_EXEMPT = ("", "point", "points")  # counts (pair_backed, tests) and differences in points
MAX_PICKS = 100_000
IDENTITY_KEYS = {"chunk_ms", "context_right", "batch", "batch_size", "frontends", "workers", "mode", "chunk"}


def spans_of(mark_words: list[str]) -> set[str]:
    """What a figures mark's `span:` words say its rows span ("files", list keys)."""
    return {w[len(SPAN) :] for w in mark_words if w.startswith(SPAN)}


def _is_object_list(v) -> bool:
    return isinstance(v, list) and any(isinstance(e, dict) for e in v)


def _own(x, key: str = "") -> list[float]:
    """An object's numbers, through nested objects and lists of numbers, not into lists of objects
    (those are records of their own); a field named as a percentage also as a fraction."""
    if isinstance(x, bool):
        return []
    if isinstance(x, (int, float)):
        return [float(x), x / 100] if PERCENT_KEY.search(key) else [float(x)]
    if isinstance(x, str):
        return [float(n.replace(",", "")) for n in re.findall(NUMBER, x)] if key == "command" else []
    if isinstance(x, dict):
        return [n for k, v in x.items() if not _is_object_list(v) for n in _own(v, k)]
    if isinstance(x, list):
        return [n for e in x for n in _own(e, key)]
    return []


def _identity(x: dict, spans: set[str], top: bool, spanned_element: bool) -> tuple:
    """What a record is of, from one object on its path: its load level fields (LEVEL_KEYS, at any
    depth); below the file's own fields (its run's date, commit, command), the settings that name a
    configuration (IDENTITY_KEYS: `chunk_ms`, `batch`, ...); and its labels (text fields), but in
    the elements of a spanned list or the object that holds a spanned field, whose labels differ by
    design (`tree_path`). A spanned field names no identity."""
    out, spanned_element = [], spanned_element or any(k in spans for k in x)  # holds the spanned field
    for k, v in x.items():
        if k in spans or isinstance(v, bool):
            continue
        if (k in LEVEL_KEYS or (k in IDENTITY_KEYS and not top)) and isinstance(v, (int, float)):
            out.append((k, v))
        elif not top and not spanned_element and isinstance(v, str):
            out.append((k, v))
    return tuple(out)


def _records(x, spans: set[str], context: list[float], group: tuple, identity: tuple, top: bool = True,
             spanned_element: bool = False) -> list[tuple]:
    """(group, numbers, identity) of each record under `x`: group names the elements of spanned
    lists and the values of spanned fields on its path; identity, what the record is of (_identity)."""
    if not isinstance(x, dict):
        return []
    here = context + _own(x)
    group += tuple((k, v) for k, v in x.items() if k in spans and isinstance(v, (str, int, float)))
    identity += _identity(x, spans, top, spanned_element)
    out = [(group, here, identity)]
    for k, v in x.items():
        if _is_object_list(v):
            for i, e in enumerate(v):
                out += _records(e, spans, here, group + ((k, i),) if k in spans else group, identity, False, k in spans)
        elif isinstance(v, dict):
            out += _records(v, spans, here, group, identity, top)[1:]  # its own numbers are in `here` already
    return out


def file_records(path: Path, spans: set[str]) -> list[tuple[tuple, list[float]]]:
    group = (path.name,) if "files" in spans else ()
    if path.suffix == ".json":
        return _records(json.loads(path.read_text()), spans, [], group, ())
    if path.suffix == ".jsonl":
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for rec in lines for r in _records(rec, spans, [], group, (), top=False)]
    return [(group, [float(n.replace(",", "")) for n in re.findall(NUMBER, line)], ())
            for line in path.read_text().splitlines()]


def _agree(pick: tuple) -> bool:
    """Whether the chosen records are of one thing: no level, label or setting with two values."""
    seen: dict[str, float] = {}
    return all(seen.setdefault(k, v) == v for _, levels in pick for k, v in levels)


def unheld(items: list[tuple[float, int, str]], recs: list[tuple], held) -> list[int]:
    """The indices of the row's figures that no allowed choice of records holds with the rest: []
    when one record per group (one group unless the table spans some), all of one level, label and
    setting but what is spanned, holds every one of them. `items`: (value, decimals, unit); `held(value, decimals, unit,
    numbers)` as page_figures'."""
    groups: dict[tuple, set[tuple]] = {}
    for group, numbers, levels in recs:
        covered = frozenset(i for i, (v, d, u) in enumerate(items) if held(v, d, u, numbers))
        if covered:
            groups.setdefault(group, set()).add((covered, levels))
    everything = frozenset(range(len(items)))
    best: frozenset = frozenset()
    # keep each group's maximal coverages per level: few, so the product stays small
    choices = [sorted(((c, lv) for c, lv in cs if not any(c < o and lv == ol for o, ol in cs)),
                      key=lambda c: (-len(c[0]), sorted(c[0]), c[1])) for cs in groups.values()]  # fmt: skip
    if math.prod(len(cs) + 1 for cs in choices) > MAX_PICKS:  # many spanned elements: each group's widest
        choices = [[max(cs, key=lambda c: len(c[0]))] for cs in choices]
    choices = [[*cs, (frozenset(), ())] for cs in choices]  # a group the row takes nothing from
    for pick in product(*choices):
        if not _agree(pick):
            continue
        union = frozenset().union(*(c for c, _ in pick))
        if union == everything:
            return []
        best = max(best, union, key=len)
    return sorted(everything - best)
