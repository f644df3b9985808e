"""Every measured figure in README.md and docs/*.md is backed by a result file, or the check names it.

A figure is a number with a unit of measure beside it (µs, ms, s, %, x, MB, GiB, streams, ...).
It is backed when it sits

- in a generated table (between `<!-- table: NAME -->` and `<!-- /table -->`, which
  performance_page.py renders from benchmarks/results/ and checks), or
- in a paragraph under `<!-- figures: FILE [FILE ...] -->` (files in benchmarks/results/), where
  every figure must equal a number those files hold, as written (its decimals) and in some unit
  scale (seconds, milliseconds, bytes, a ratio as a percentage, ...).

A paragraph under `<!-- figures: settings -->` states the settings of a run, a test or a recipe
(packet sizes, durations, thresholds it was given), not what came out: its numbers are not checked.

A count of cases, `k/n`, `k / n` or `k of n` (24/24 transcripts equal, 5 of 24 changed), is a
figure too, without a unit, also on a line that names a flag: backed by the test that asserts it
when its paragraph (up to it) or its table row names that test (`tests/test_x.py`, a file that
exists), else by the paragraph's result files as above; with neither it fails.

A difference in points (`missed by 0.4 points`) must be the difference of two numbers of one
object of the file whose keys share a word (`wer_demo`, `wer_eou_model`), as a fraction or in percent.

A line that names a result file (`packet_cost_cpu.json`, in benchmarks/results/) is checked
against it as well as against its paragraph's files; the numbers of a file include those of the
`command` that made it (a run's settings, `--streams 32`, are backed by the run).

A number alone in a cell of a hand-written table row (`| high | 32 | 106 | 188 |`, its unit in the
header) is a figure too where the row has result files (a `figures: FILE` mark or a named file)
and its table is not one of limits or defaults:
it must equal a number of those files in some scale of time, size or percentage, and a small one
(10 or less) needs a record that holds another figure of its row. The header row and each row's
first cell (its label: `unseen sentences, 1120 ms`, `websockets 17.4`) are not read.

The figures of one hand-written table row must all come from one record of its files, not one cell
from the 64-stream run and another from the 128-stream run; a table whose rows span records (two
files, a before and an after tree) says so on its mark with `span:` words (page_rows.py).

A `#` comment in a fenced block is prose (`# 862 examples, 75 s wall`), each comment a sentence of
its own; a fenced block is one paragraph, so a `figures: settings` mark above it covers its comments.

Not figures: code (fenced blocks but their comments, and `inline`), chunk durations (a mode is configured, not
measured), and lines (or tables, by their header) that state a configured limit or a flag's
default: they name a `--flag`, or say "default", "limit" or "cap", and no result file backs
them (under a `figures: FILE` mark, or naming a result file, such a line is checked: a
measurement quoted beside a flag is still a measurement). NOT_MEASURED below is the short,
explicit list of the rest.

The match against a file's numbers is loose (any number of the file, any scale): it catches a
figure no file holds, or one copied wrong, not one copied from the wrong key. Where looseness let
wrong figures through, it is tighter (performance_page_records.py): a count's two numbers must come
from one record of the file, a small whole number with a unit (10 or less) from a record that holds
another figure of its sentence (or the run's own flags, or a field naming its unit), and a
percentage from a fraction (x 100, rounded as written) or a field named as a percentage; and in a
sentence that names a level (`64 streams`), a figure held only by records of levels the sentence
does not name (another run's p95) is named.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from benchmarks.page_rows import ROW_RULES_EXEMPT, SPAN, file_records, spans_of, unheld
from benchmarks.performance_page_records import (is_count, is_small, level_backed, pair_backed, percent_numbers,
                                                 records as records_of, small_backed)

UNITS = r"µs|us|ms|s|%|points?|x|times|MB|MiB|GB|GiB|kB|KB|KiB|bytes|streams|tokens|min|minutes|seconds|hours|cores?|waits?|ticks"
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w./-])({NUMBER}(?:\s?(?:-|to|/)\s?{NUMBER})*)\s?({UNITS})(?!\w)")
INTEGER = r"(?:\d{1,3}(?:,\d{3})+|\d+)"
BARE_NUMBER = re.compile(rf"(?<![\w./-]){NUMBER}(?![\w.])")  # any number of a sentence: `96` in "the replica 96"
COUNT = re.compile(rf"(?<![\w./-])(?<!HTTP )({INTEGER}\s?(?:/|of)\s?{INTEGER})(?![\w./-]|\s?(?:{UNITS})(?!\w))")
TEST_FILE = re.compile(r"tests/test_\w+\.py")
RESULT_FILE = re.compile(r"(?<![\w.-])([\w.-]+\.jsonl?)(?![\w.-])")
SENTENCE_END = re.compile(r"[.;:](?:\s+|$)(?=[A-Z(*`]|$)")
CELL_NUMBER = re.compile(r"(?<![\w./-])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w.%])")  # no unit of its own
TABLE_RULE = re.compile(r"^\|[\s:|-]+\|?\s*$")  # |---|---:| under a table's header
CELL = "cell"  # the unit of a bare number in a table cell: its header says which; any scale of one
CHUNK_MS = {80, 160, 320, 480, 560, 640, 1120}  # chunk modes of the served models: configured, not measured
CONFIG_LINE = re.compile(r"`--[a-z]|\bdefaults?\b|\blimits?\b|\bcaps?\b", re.I)
FIGURES_MARK = re.compile(r"^<!-- figures: ([^>]+?) -->$")

# Numbers with units that state a design, a protocol or a test's own setting, not a measurement.
# (page, exact text of the figure). Keep it short: a measurement never goes here.
NOT_MEASURED = {
    ("docs/server.md", "5%"),  # the overload cap's growth per second (admission.py)
    ("docs/server.md", "1 s"),  # a closing frame's write deadline (outbox)
    ("docs/protocol.md", "64 kB"),  # a socket's kernel send buffer; NIM's session body bound
    ("docs/protocol.md", "30 s"),  # a file transcription's deadline past its audio's duration
    ("docs/how_it_works.md", "1.2 s"), ("docs/how_it_works.md", "20 s"),  # endpoint rules' defaults
    ("docs/how_it_works.md", "8 streams"),  # the device-wait test's batch (a test setting)
    ("docs/demo_model.md", "2 points"),  # the WER target's bound for chained decoding (a target)
    ("docs/performance.md", "4 GiB"),  # the step cache's default cap (engine/buckets.py)
    ("docs/performance.md", "3 tokens"),  # the GPU benchmark's decoder cap per frame (benchmarks/gpu/)
}

# Measured figures known to be unbacked on a page this branch may not edit (another branch owns it):
# --check prints each and does not fail on it, until its owner backs or removes it. Never a new one.
PENDING: dict[tuple[str, str], str] = {}  # (page, "figure unit") -> why it waits for its page's owner

SCALES = {  # unit -> the factors from a result file's number to the unit written
    "time": (1, 1e3, 1e-3, 1e6, 1e-6, 1 / 60, 1 / 3600),
    "%": (100,),  # a fraction; a field named as a percentage is passed in already divided by 100
    "x": (1,),
    "bytes": (1, 1e-3, 1e-6, 1e-9, 2**-10, 2**-20, 2**-30, 1e3, 1e6),
    "count": (1,),
    CELL: (1, 1e3, 1e-3, 1e6, 1e-6, 1 / 60, 100, 1e-9, 2**-10, 2**-20, 2**-30),  # time, %, size
}
UNIT_KIND = {"µs": "time", "us": "time", "ms": "time", "s": "time", "min": "time", "minutes": "time",
             "seconds": "time", "hours": "time", "%": "%", "point": "count", "points": "count", "x": "x", "MB": "bytes", "MiB": "bytes",
             "GB": "bytes", "GiB": "bytes", "kB": "bytes", "KB": "bytes", "KiB": "bytes", "bytes": "bytes", "times": "x",
             "streams": "count", "tokens": "count", "core": "count", "cores": "count", "wait": "count", "waits": "count",
             "ticks": "count", CELL: CELL}


def _blank(m: re.Match) -> str:
    return "\n" * m.group(0).count("\n")


def _blank_code(m: re.Match) -> str:
    return "``" + "\n" * m.group(0).count("\n")


CODE_COMMENT = re.compile(r"(?:^|\s)#(?![!#])\s?(.*)$")  # `# 862 examples` after a command; not `#!` or `##`


def _comments_only(m: re.Match) -> str:
    """A fenced block with its code blanked and its `#` comments kept: a figure in a comment is a claim."""
    lines = m.group(0).split("\n")
    kept = [(c.group(1) if (c := CODE_COMMENT.search(line)) else "") for line in lines[1:-1]]
    return "\n".join(["", *kept, ""])


def fenced_lines(text: str) -> set[int]:
    """The 0-based numbers of the lines inside fenced blocks (not the fences)."""
    out, fenced = set(), False
    for i, line in enumerate(text.split("\n")):
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            out.add(i)
    return out


def code_comment_lines(text: str) -> set[int]:
    """The 0-based numbers of the lines of fenced blocks that hold a `#` comment (each a sentence)."""
    lines = text.split("\n")
    return {i for i in fenced_lines(text) if CODE_COMMENT.search(lines[i])}


def _prose(text: str) -> str:
    """The page with code (but its `#` comments), generated tables, HTML comments and link targets
    blanked; lines keep their numbers."""
    text = re.sub(r"^```.*?^```", _comments_only, text, flags=re.S | re.M)
    text = re.sub(r"<!-- table: [\w-]+ -->.*?<!-- /table -->", _blank, text, flags=re.S)
    text = re.sub(r"<!--(?! figures:).*?-->", _blank, text, flags=re.S)
    # inline code may wrap a line, not cross a blank line or a figures mark
    text = re.sub(r"`(?:[^`\n]|\n(?![ \t]*\n|<!-- figures:))*`", _blank_code, text)
    return re.sub(r"\]\([^)]*\)", "]()", text)


def _values(parts: str) -> list[tuple[float, int]]:
    """(value, decimals) of each number in a figure such as `52-62` or `2.5 / 3.1`."""
    out = []
    for n in re.findall(NUMBER, parts.replace(" of ", " / ")):
        n = n.replace(",", "")
        out.append((float(n), len(n.split(".")[1]) if "." in n else 0))
    return out


def is_config(figure: str, unit: str) -> bool:
    return unit == "ms" and all(v in CHUNK_MS for v, _ in _values(figure))


def _cells_after_the_first(row: str) -> list[tuple[int, str]]:
    """(offset in the row, text) of each cell of a table row but its first (the row's label)."""
    out, at = [], row.index("|") + 1
    for k, cell in enumerate(row[at:].split("|")):
        if k:
            out.append((at, cell))
        at += len(cell) + 1
    return out


def _bare_numbers(cell: str) -> list[re.Match]:
    """The numbers of a cell that no figure (a number with its unit) or count (`a / b`) holds."""
    taken = [m.span() for m in FIGURE.finditer(cell)] + [m.span() for m in COUNT.finditer(cell)]
    return [m for m in CELL_NUMBER.finditer(cell) if not any(a <= m.start() < b for a, b in taken)]


def figures(page: str, text: str, root: Path | None = None,
            results: Path | None = None) -> list[tuple[int, str, str, list[str], int, list[float]]]:
    """(line, figure, unit, result files of its paragraph, or [], sentence number, every number of
    its sentence) of every figure on a page; a count (unit "") on a line naming tests under `root`
    carries those tests instead of result files. A table row is a sentence of its own."""
    out, files, config_table, tests, sentence = [], [], False, [], 0
    # sentence -> its numbers: one list per sentence, filled on as its later lines are read, so a
    # figure's entry holds its whole sentence's once the page is read
    numbers: dict[int, list[float]] = {}
    raw, comments, fence_lines = text.split("\n"), code_comment_lines(text), fenced_lines(text)

    def sentence_at(line: str, pos: int) -> int:
        return sentence + len(SENTENCE_END.findall(line[:pos]))

    for i, line in enumerate(_prose(text).split("\n")):
        sentence += 1 if line.startswith("|") or i in comments or not raw[i].strip() else 0
        mark = FIGURES_MARK.match(line.strip())
        if mark:
            files = [w for w in mark.group(1).split() if not w.startswith(SPAN)]  # `span:` words: page_rows
            continue
        if not raw[i].strip() and i not in fence_lines:  # the page's blank line (a wrapped code span
            # leaves blank prose lines; a fenced block is one paragraph: a settings mark above it covers it)
            files, tests = [], []
        if files == ["settings"]:
            sentence += len(SENTENCE_END.findall(line))
            continue
        # a count of cases is a result even on a line that names a flag: checked before that rule
        named = [t for t in TEST_FILE.findall(raw[i]) if root is not None and (root / t).is_file()]
        in_scope = named if line.startswith("|") else tests + named  # a table row names its own test
        for m in BARE_NUMBER.finditer(line):
            numbers.setdefault(sentence_at(line, m.start()), []).append(float(m.group(0).replace(",", "")))
        for m in COUNT.finditer(line):
            at = sentence_at(line, m.start())
            out.append((i + 1, m.group(1), "", in_scope or files, at, numbers.setdefault(at, [])))
        # a test named in a sentence backs the counts of that sentence only
        ends = list(SENTENCE_END.finditer(raw[i]))
        rest = raw[i][ends[-1].end() :] if ends else None
        tests = in_scope if rest is None else [t for t in TEST_FILE.findall(rest) if t in named]
        if line.startswith("|") and not (i and raw[i - 1].startswith("|")):
            config_table = bool(CONFIG_LINE.search(raw[i]))  # a table of limits or defaults, by its header
        # A line that names a result file is checked against it; a flag or "default" on a line exempts
        # its figures only where no result file is named for them (a measurement quoted beside a flag
        # is still a measurement).
        named_files = [f for f in RESULT_FILE.findall(raw[i]) if results is not None and (results / f).is_file()]
        backing = files + [f for f in named_files if f not in files]
        said = line if i in comments else raw[i]  # a comment's flag words, not its command's (`--dev-limit`)
        if not backing and (CONFIG_LINE.search(said) or (config_table and line.startswith("|"))):
            sentence += len(SENTENCE_END.findall(line))
            continue
        for m in FIGURE.finditer(line):
            fig, unit = m.group(1), m.group(2)
            checked = not is_config(fig, unit) and (page, m.group(0)) not in NOT_MEASURED
            # a setting is not checked, yet it is a figure of its sentence (small_backed's company)
            at = sentence_at(line, m.start())
            out.append((i + 1, fig, unit, backing if checked else None, at, numbers.setdefault(at, [])))
        if line.startswith("|") and backing and not config_table:  # a table of flags states settings
            header = i + 1 < len(raw) and bool(TABLE_RULE.match(raw[i + 1]))
            for at, cell in ([] if header else _cells_after_the_first(line)):
                for m in _bare_numbers(cell):
                    where = sentence_at(line, at + m.start())
                    out.append((i + 1, m.group(0), CELL, backing, where, numbers.setdefault(where, [])))
        sentence += len(SENTENCE_END.findall(line))
    return out


def _numbers(path: Path) -> list[float]:
    if path.suffix in (".json", ".jsonl"):
        out: list[float] = []

        def walk(x):
            if isinstance(x, bool):
                return
            if isinstance(x, (int, float)):
                out.append(float(x))
            elif isinstance(x, dict):
                for k, v in x.items():
                    if k == "command" and isinstance(v, str):  # the run's settings (`--streams 32`)
                        out.extend(float(n.replace(",", "")) for n in re.findall(NUMBER, v))
                    else:
                        walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)

        for chunk in [path.read_text()] if path.suffix == ".json" else path.read_text().splitlines():
            if chunk.strip():
                walk(json.loads(chunk))
        return out
    return [float(n.replace(",", "")) for n in re.findall(NUMBER, path.read_text())]


def _sibling_differences(path: Path) -> list[float]:
    """|a - b| and 100 |a - b| for two numbers of one object in a JSON result whose keys share a word
    (`wer_demo` and `wer_eou_model` of one row): what a difference "in points" may be."""
    out: list[float] = []

    def walk(x):
        if isinstance(x, dict):
            nums = [(set(k.split("_")), v) for k, v in x.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            out.extend(abs(a - b) * s for i, (ka, a) in enumerate(nums) for kb, b in nums[i + 1 :] if ka & kb for s in (1, 100))
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    text = path.read_text() if path.suffix in (".json", ".jsonl") else ""
    for chunk in [text] if path.suffix == ".json" else text.splitlines():
        if chunk.strip():
            walk(json.loads(chunk))
    return out


def held(value: float, decimals: int, unit: str, numbers: list[float]) -> bool:
    """Whether some number of the file, scaled to the unit and rounded as written, is the figure
    (a count, unit "", as it is)."""
    half = 0.5 * 10**-decimals + 1e-9
    for scale in SCALES[UNIT_KIND.get(unit, "count")]:
        for n in numbers:
            x = n * scale
            if UNIT_KIND.get(unit) == "x" and n:  # "sherpa-onnx is 1.8x faster" from engine_over_sherpa 0.558
                x = x if abs(abs(x) - abs(value)) <= half else 1 / n
            if abs(abs(x) - abs(value)) <= half or (unit == "%" and abs(abs((n - 1) * 100) - abs(value)) <= half):
                return True
    return False


def unbacked(root: Path, results: Path, pages: list[str]) -> list[str]:
    """'page:line: figure (why)' for every figure on the pages that no generated table or named file backs."""
    problems, cache = [], {}
    for page in pages:
        named: set[tuple[int, str]] = set()  # (line, figure) named already: not named again as a row's
        found = figures(page, (root / page).read_text(), root, results)
        for line, fig, unit, files, sentence, said in found:
            where = f"{page}:{line}: {fig} {'(a table cell)' if unit == CELL else unit}".rstrip()
            if files is None or (page, f"{fig} {unit}") in PENDING:
                continue  # a chunk mode, a NOT_MEASURED setting, or a figure PENDING its page's owner
            if not files:
                problems.append(f"{where} (no result file backs it)")
                continue
            if all(TEST_FILE.fullmatch(f) for f in files):
                continue  # a count of cases on the line of the test that asserts it
            missing = [f for f in files if not (results / f).is_file()]
            if missing:
                problems.append(f"{where} (no such result file: {', '.join(missing)})")
                continue
            recs = [r for f in files for r in cache.setdefault(("records", f), records_of(results / f))]
            others = [(v, d, u) for at, g, u, _, s, _ in found if s == sentence and (at, g) != (line, fig) for v, d in _values(g)]
            why = _why_unbacked(fig, unit, files, recs, others, cache, results)
            if why is None and any(u == "streams" for _, _, u in others) and unit not in ("", "%", "streams"):
                if not level_backed(_values(fig), unit, said, recs, held):  # the sentence names a level
                    why = f"only in records of levels its sentence does not name ({', '.join(files)})"
            if why:
                problems.append(f"{where} ({why})")
                named.add((line, fig))
        problems += _mixed_rows(page, (root / page).read_text(), [f for f in found if f[:2] not in named], results, cache)
    return problems


def row_spans(text: str) -> dict[int, set[str]]:
    """line (1-based) of each table row -> what its paragraph's figures mark says its rows span."""
    out, spans, fenced = {}, set(), False
    for i, line in enumerate(text.split("\n")):
        fenced = fenced != line.startswith("```")
        if mark := FIGURES_MARK.match(line.strip()):
            spans = spans_of(mark.group(1).split())
        elif not line.strip() and not fenced:
            spans = set()
        elif line.startswith("|"):
            out[i + 1] = spans
    return out


def _mixed_rows(page: str, text: str, found: list, results: Path, cache: dict) -> list[str]:
    """'page:line: ...' for each hand-written table row whose figures no one record holds together
    (page_rows.py: a record, and how a table says its rows span several)."""
    spans, rows = row_spans(text), {}
    for line, fig, unit, files, _, _ in found:
        if line in spans and files and unit not in ROW_RULES_EXEMPT and not all(TEST_FILE.fullmatch(f) for f in files):
            rows.setdefault((line, tuple(files)), []).extend(
                (v, d, unit, fig) for v, d in _values(fig) if not math.isnan(v))
    problems = []
    for (line, files), items in rows.items():
        if len(items) < 2 or any(not (results / f).is_file() for f in files):
            continue  # one figure is one record; a missing file is named above
        key = ("rows", files, frozenset(spans[line]))
        recs = cache.get(key) or cache.setdefault(key, [r for f in files for r in file_records(results / f, spans[line])])
        left = unheld([(v, d, u) for v, d, u, _ in items], recs, held)
        if left:
            figs = ", ".join(dict.fromkeys(items[k][3] for k in left))
            problems.append(f"{page}:{line}: a table row ({figs} not held by the record that holds the rest of the row; "
                            f"one record per row of {', '.join(files)}, or say `span:` on its figures mark)")
    return problems


def _why_unbacked(fig: str, unit: str, files: list[str], recs: list, others: list, cache: dict,
                  results: Path) -> str | None:
    """Why a figure under result files is not backed by them, or None (performance_page_records.py
    says what must be held together)."""
    values = [(v, d) for v, d in _values(fig) if not math.isnan(v)]
    if unit == "" and len(values) == 2 and is_count(values[0][0], values[1][0]):  # its two numbers together
        return None if pair_backed(values[0][0], values[1][0], recs) else f"not a pair of one record of {', '.join(files)}"
    if unit.startswith("point"):  # "missed by 0.4 points": a difference of two rates side by side
        nums = [n for f in files for n in cache.setdefault(("points", f), _sibling_differences(results / f))]
    elif unit == "%":
        every, named = percent_numbers(recs)
        nums = every + [n / 100 for n in named]  # a field named as a percentage holds it as written
    else:
        nums = [n for f in files for n in cache.setdefault(f, _numbers(results / f))]
    if any(not held(v, d, unit, nums) for v, d in values):
        return f"not in {', '.join(files)}"
    small = [v for v, d in values if is_small(v, d) and unit != "%"]
    company = others + [(v, d, unit) for v, d in values]  # "8-30 s": its other end is company too
    if small and not all(small_backed(v, unit, [c for c in company if c[0] != v], recs, held) for v in small):
        return f"a small number alone: no record of {', '.join(files)} holds it with another figure of its sentence"
    return None
