"""Reading benchmarks/results/ for the generated tables: a result file, the command, commit and
date that made it, the line under a table that names them, and the model a number was measured on."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from benchmarks.performance_page_outs import copied_note

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"  # the one place the tables read from (tests point it at a copy)
SHIPPED_DEMO = ROOT / "nemo_serve" / "assets" / "demo" / "demo.nemo"


def read(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def run_info(d: dict) -> dict:
    """command, commit, date and CPU of a result, wherever its script put them."""
    r = d.get("run", d)
    # a run stamped dirty ran code that was not all committed (before 2026-12-05 the results
    # folder itself counted, so older files may say so for that alone)
    commit = r.get("git_commit") or "no commit recorded"
    dirty_files = r.get("git_dirty_files")
    commit += f" (dirty: {', '.join(dirty_files)})" if r.get("git_dirty") and dirty_files else ""
    commit += " (dirty)" if r.get("git_dirty") and not dirty_files else ""
    return {"command": r.get("command", "?"), "commit": commit,
            "date": str(r.get("date", "?"))[:10], "cpu": r.get("cpu", "?"), "cpu_count": r.get("cpu_count")}


def source(names: list[str], infos: list[dict]) -> str:
    lines = [f"- `{n}`: `{_short(i['command'])}`{copied_note(n, i['command'])} at {i['commit']}, {i['date']}"
             for n, i in zip(names, infos)]
    return "\n\nFrom " + ("these files:\n\n" if len(lines) > 1 else "") + ("\n".join(lines) if len(lines) > 1 else lines[0][2:])


def _short(command: str) -> str:
    """The command without its free-text --notes (the file keeps them)."""
    return re.sub(r" --notes ('([^']|'\"'\"')*'|\S+)", " --notes ...", command)


def shipped_sha() -> str:
    return hashlib.sha256(SHIPPED_DEMO.read_bytes()).hexdigest()


def model_label(d: dict) -> str:
    """The demo model is retrained now and then: say when a number is not the shipped weights'."""
    # model_sha256 is a prefix of the digest where the script shortened it (step_bench: 12 characters)
    if d.get("model") == "demo" and d.get("model_sha256") and not shipped_sha().startswith(d["model_sha256"]):
        return f"demo (earlier weights, {d['model_sha256'][:7]})"
    return str(d.get("model"))


def fmt(x, nd=0, unit="") -> str:
    return "-" if x is None else f"{x:,.{nd}f}{unit}"


def sweep_groups() -> list[tuple[list[str], dict]]:
    """Sweep files, a run's levels split over two files (`_high` or `_top`: the higher levels, a
    later run at the same commit) joined into one."""
    groups: dict[str, tuple[list[str], dict]] = {}
    for p in sorted(RESULTS.glob("sweep_*.json")):
        d = json.loads(p.read_text())
        key = re.sub(r"_(high|top)_", "_", p.name)
        if key in groups:
            groups[key][0].append(p.name)
            groups[key][1]["levels"] = sorted(groups[key][1]["levels"] + d["levels"], key=lambda lv: lv["streams"])
        else:
            groups[key] = ([p.name], d)
    return list(groups.values())
