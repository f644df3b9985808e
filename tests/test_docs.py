"""The documentation: README.md stays a short front door whose links resolve, and every table
of docs/performance.md, README.md's headline and docs/demo_model.md's WER table equals what
benchmarks/performance_page.py renders from benchmarks/results/ (no hand-edited numbers)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import performance_page

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 12 * 1024
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.encode()) <= README_MAX_BYTES, len(text.encode())
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("bash env/setup.sh && .venv/bin/nemo-serve --selftest 20")
    assert first_block[1].startswith(".venv/bin/python -m pytest")
    assert ".venv/bin/python -m pytest" in (ROOT / ".ci" / "run").read_text()  # the second is what CI runs


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.M)}


@pytest.mark.parametrize("page", ["README.md", "docs/server.md", "docs/performance.md", "docs/demo_model.md",
                                  "docs/how_it_works.md", "docs/protocol.md", "docs/ray_serve.md", "benchmarks/README.md", "CHANGELOG.md"])
def test_relative_links_resolve(page):
    path = ROOT / page
    text = path.read_text()
    broken = []
    for target, anchor in LINK.findall(text) + [(page, a) for a in re.findall(r"\]\((#[^)]+)\)", text)]:
        if "://" in target or target.startswith("mailto:"):
            continue
        file = path if target == page else path.parent / target
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor[1:] not in _anchors(file.read_text()):
            broken.append(target + anchor)
    assert not broken, f"{page} has links that lead nowhere: {broken}"


def test_pages_match_their_result_files():
    assert performance_page.main(["--check"]) == 0, "run: python benchmarks/performance_page.py"
    for page in performance_page.PAGES:
        assert "<!-- table: " in (ROOT / page).read_text(), page


def test_a_changed_result_changes_the_page(tmp_path, monkeypatch):
    """The tables are read from the files: a level that fell behind must show as fewer streams kept up."""
    results = tmp_path / "results"
    shutil.copytree(performance_page.RESULTS, results)
    gpu = results / performance_page.GPU_RUN["file"]
    recs = [json.loads(line) for line in gpu.read_text().splitlines() if line.strip()]
    for r in recs:
        if r["kind"] == "capacity" and r["chunk_ms"] == 80:
            r["keeps_up"] = False
    gpu.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    monkeypatch.setattr(performance_page, "RESULTS", results)

    row = next(line for line in performance_page.table_gpu().splitlines() if line.startswith("| 80 ms"))
    assert "| **0** " in row and "missed" in row, row
    page = (ROOT / "docs" / "performance.md").read_text()
    assert performance_page.render(page, {}) != page


def test_the_overload_table_is_read_from_its_files(tmp_path, monkeypatch):
    """The overload figures come from the overload results: a changed file changes the page."""
    results = tmp_path / "results"
    shutil.copytree(performance_page.RESULTS, results)
    path = results / "overload_demo_r13_cpu.json"
    d = json.loads(path.read_text())
    d["runs"][1]["level"]["quality"]["token_identical_streams"] -= 1
    path.write_text(json.dumps(d))
    monkeypatch.setattr(performance_page, "RESULTS", results)
    row = next(line for line in performance_page.table_overload().splitlines() if "token-identical" in line)
    assert "| 293/294 |" in row, row
    page = (ROOT / "docs" / "performance.md").read_text()
    assert performance_page.render(page, {}) != page
