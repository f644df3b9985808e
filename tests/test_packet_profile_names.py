"""benchmarks/packet_profile.py sorts py-spy samples by file and function names: each name it
matches must still be in the tree, or a moved function silently falls into "other" (as
on_ws_frame would have when it moved from picows_listener.py to picows_connection.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.packet_profile import COMPONENTS, PHASES

PACKAGE = Path(__file__).resolve().parent.parent / "nemo_serve"
SOURCES = {f.relative_to(PACKAGE).as_posix(): f for f in PACKAGE.rglob("*.py")}


def _ours(where: str) -> list[Path]:
    return [f for name, f in SOURCES.items() if ("/" + name).endswith("/" + where)]


@pytest.mark.parametrize("function, where", [key for key, _ in PHASES if key[1].endswith(".py")])
def test_each_phase_names_a_function_in_its_file(function, where):
    files = _ours(where)
    assert files, f"{where}: no such file in nemo_serve"
    assert any(f"def {function}(" in f.read_text() for f in files), f"{function} not defined in {where}"


@pytest.mark.parametrize("where", [w for w, _ in COMPONENTS if w.endswith(".py") and "/" in w])
def test_each_component_file_is_ours(where):
    assert _ours(where), f"{where}: no such file in nemo_serve"
