"""Where each result file's recorded command wrote its output (issue 51, audit item 3).

A result file records the command that made it. When that command's `--out` (or `> FILE`) is not
the file itself (`--out /tmp/x.json`, or another name in benchmarks/results/ that was renamed), the
command alone does not say the file came from it: the docs must say it was copied. The line under
a generated table says so by itself (page_results.source calls `copied_note`); elsewhere a line of
README.md, docs/*.md or benchmarks/README.md that names the file must say "copied", "renamed" or
"kept as". `unsaid_copies` names every file for which none does.

A command with no `--out` and no `>` (a script that prints, a placeholder such as `OUT`) is not
checked: it names no other place. Files in results/archive/ are superseded and not checked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

OUT = re.compile(r"(?:--out(?:=|\s+)|(?<![\d>])>\s*)(?P<path>[^\s'\"]+)")
SAYS_COPIED = re.compile(r"\bcopied\b|\brenamed\b|\bkept as\b", re.I)
NOTES = re.compile(r" --notes ('([^']|'\"'\"')*'|\S+)")  # as page_results._short
PLACEHOLDERS = {"OUT", "DIR", "FILE"}  # a command written with a placeholder names no real path


def recorded_command(path: Path) -> str | None:
    """The command a result file says made it: its `run` record's, or its top-level `command`."""
    chunks = [path.read_text()] if path.suffix == ".json" else path.read_text().splitlines()
    for chunk in chunks:
        if not chunk.strip():
            continue
        rec = json.loads(chunk)
        if not isinstance(rec, dict):
            continue
        run = rec.get("run") if isinstance(rec.get("run"), dict) else rec
        if run.get("kind", "run") == "run" and isinstance(run.get("command"), str):
            return run["command"]
    return None


def written_elsewhere(name: str, command: str) -> str | None:
    """The path the command wrote to, when that is not benchmarks/results/NAME; else None."""
    command = NOTES.sub("", command)  # free text may hold a '>' or an '--out' of its own
    if re.search(rf"(?:^|[\s=])(?:\S*/)?benchmarks/results/{re.escape(name)}(?:\s|$)", command):
        return None  # written by another flag of its own (`--report FILE` beside a model's `--out`)
    outs = [m.group("path") for m in OUT.finditer(command) if m.group("path") not in PLACEHOLDERS]
    if not outs or any(o == name or o.endswith(f"benchmarks/results/{name}") for o in outs):
        return None
    return outs[-1]


def copied_note(name: str, command: str) -> str:
    """' (written to X, copied here)' for a generated table's source line, or ''."""
    out = written_elsewhere(name, command)
    return f" (written to `{out}`, copied here)" if out else ""


def unsaid_copies(root: Path, results: Path, pages: list[str]) -> list[str]:
    """'FILE: its command wrote X; no line naming it says it was copied' for each such file."""
    lines = [line for page in pages if (root / page).is_file() for line in (root / page).read_text().splitlines()]
    problems = []
    for path in sorted([*results.glob("*.json"), *results.glob("*.jsonl")]):
        command = recorded_command(path)
        out = written_elsewhere(path.name, command) if command else None
        if out and not any(path.name in line and SAYS_COPIED.search(line) for line in lines):
            problems.append(f"{path.name}: its command wrote {out}; no line naming it says it was copied")
    return problems
