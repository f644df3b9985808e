"""Other projects' private APIs sit behind one adapter each (nemo_private.py for NeMo,
server/uvicorn_protocols.py for uvicorn), which checks the installed version at import. Here: the
installed versions are inside those ranges, pyproject.toml and the CPU lock pin inside them too,
and a version outside one fails at import with a message that names it."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from nemo_serve import versions
from nemo_serve.nemo_private import NEMO_VERSIONS
from nemo_serve.server.uvicorn_protocols import UVICORN_VERSIONS

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = {"uvicorn": UVICORN_VERSIONS, "nemo_toolkit": NEMO_VERSIONS}


@pytest.mark.parametrize("distribution", sorted(ADAPTERS))
def test_installed_version_is_in_the_tested_range(distribution):
    installed = importlib.metadata.version(distribution)
    minimum, below = ADAPTERS[distribution]
    assert versions.in_range(installed, minimum, below), f"{distribution} {installed} is outside >={minimum},<{below}"


def _requirement(distribution: str) -> str:
    """The version part of pyproject.toml's dependency on `distribution`."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(rf"{distribution}(\[[^\]]*\])?\s*(.*)", dep, flags=re.IGNORECASE)
        if m:
            return m.group(2).replace(" ", "")
    raise AssertionError(f"{distribution} not in pyproject.toml's dependencies")


def test_pyproject_pins_what_the_adapters_check():
    minimum, below = UVICORN_VERSIONS
    assert _requirement("uvicorn") == f">={minimum},<{below}"
    pin = _requirement("nemo_toolkit")
    assert pin.startswith("==") and versions.in_range(pin[2:], *NEMO_VERSIONS), pin
    lock = dict(line.split("==") for line in (ROOT / "env/cpu.lock.txt").read_text().split() if "==" in line)
    lock = {k.lower().replace("_", "-"): v for k, v in lock.items()}
    for distribution, (minimum, below) in ADAPTERS.items():
        version = lock[distribution.lower().replace("_", "-")]
        assert versions.in_range(version, minimum, below), f"env/cpu.lock.txt: {distribution}=={version}"


def test_an_untested_version_fails_at_import_with_its_name(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.34.2" if d == "uvicorn" else real(d))
    monkeypatch.delenv("NEMO_SERVE_ALLOW_UNTESTED", raising=False)
    monkeypatch.delitem(sys.modules, "nemo_serve.server.uvicorn_protocols")
    with pytest.raises(ImportError, match=r"uvicorn 0\.34\.2 is outside the range .*>=0\.35,<"):
        importlib.import_module("nemo_serve.server.uvicorn_protocols")
    monkeypatch.setenv("NEMO_SERVE_ALLOW_UNTESTED", "1")  # on purpose: a warning, and it imports
    assert importlib.import_module("nemo_serve.server.uvicorn_protocols").UVICORN_VERSIONS == UVICORN_VERSIONS


@pytest.mark.parametrize("version, minimum, below, inside", [
    ("0.35.0", "0.35", "0.55", True), ("0.54.0", "0.35", "0.55", True), ("0.55.0", "0.35", "0.55", False),
    ("0.34.9", "0.35", "0.55", False), ("0.100.1", "0.35", "0.55", False), ("2.13.0+cpu", "2.13", "2.14", True),
])  # fmt: skip
def test_version_ranges_compare_releases_as_numbers(version, minimum, below, inside):
    assert versions.in_range(version, minimum, below) is inside


# The NeMo and torch internals this package reaches, and where each may be named: only in its adapter.
LEAKS = {
    r"torch\._C\b": (),  # torch's public switches serve (engine/step.py aten_rnn: torch.backends.mkldnn)
    r"\._blank_index\b|\.INITIAL_MAX_TIME\b|\.full_graph\b|\.separate_graphs\b": ("nemo_private.py",),
}


@pytest.mark.parametrize("pattern", sorted(LEAKS))
def test_private_apis_are_named_only_in_their_adapter(pattern):
    package = ROOT / "nemo_serve"
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in sorted(package.rglob("*.py"))
             if f.name not in LEAKS[pattern] for i, line in enumerate(f.read_text().splitlines(), 1)
             if re.search(pattern, line)]  # fmt: skip
    assert not found, "outside the adapter:\n" + "\n".join(found)
