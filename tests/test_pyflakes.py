"""pyflakes finds nothing in nemo_serve: no unused import, undefined name (string annotations
included) or unused local. A deliberate re-export goes in the module's `__all__`, which pyflakes
reads; it does not read `# noqa` comments."""

from __future__ import annotations

import io
from pathlib import Path

from pyflakes.api import checkRecursive
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parent.parent



def findings(path: Path) -> list[tuple[Path, str]]:
    """(file, message) for each pyflakes warning or error under `path`."""
    warnings, errors = io.StringIO(), io.StringIO()
    checkRecursive([str(path)], Reporter(warnings, errors))
    out = []
    for line in (warnings.getvalue() + errors.getvalue()).splitlines():
        file, _, rest = line.partition(":")  # file:line:col: message
        out.append((Path(file).resolve(), rest.split(": ", 1)[-1]))
    return out


def test_pyflakes_finds_nothing_in_the_package():
    found = [(str(f.relative_to(ROOT)), m) for f, m in findings(ROOT / "nemo_serve")]
    assert not found, "\n".join(f"{file}: {message}" for file, message in found)


def test_the_check_sees_each_kind_of_finding(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f() -> 'Missing':\n    unused = 1\n")
    assert {m for _, m in findings(bad)} == {
        "'os' imported but unused", "undefined name 'Missing'", "local variable 'unused' is assigned to but never used",
    }  # fmt: skip
