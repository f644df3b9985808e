"""An installed package finds its configs and ships every module; the server does not load the built-ins' code.

The whole check by hand (a wheel, installed, no source checkout on the path):

    .venv/bin/python -m pip wheel --no-deps -w /tmp/whl . && mkdir /tmp/inst && cd /tmp/inst && unzip -q /tmp/whl/*.whl
    cd /tmp && PYTHONPATH=/tmp/inst /work/main/.venv/bin/python -c \
        "from nemo_serve.config_files import config_dir; print(config_dir())"   # /tmp/inst/nemo_serve/configs
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nemo_serve
from nemo_serve import config_files

PACKAGE = Path(nemo_serve.__file__).parent
REPO = PACKAGE.parent


def test_pyproject_lists_every_package_and_maps_configs():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    code = {".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("*.py")}
    assert code <= listed, f"not in pyproject.toml's packages (the wheel would lack them): {sorted(code - listed)}"
    assert setuptools["package-dir"]["nemo_serve.configs"] == "configs"
    for name in listed:  # every listed package is a folder of the source tree
        parts = name.split(".")
        folder = REPO / "configs" / Path(*parts[2:]) if parts[1:2] == ["configs"] else REPO / Path(*parts)
        assert folder.is_dir(), name


def test_config_dir_of_an_installed_package(tmp_path):
    site = tmp_path / "site" / "nemo_serve"
    (site / "configs").mkdir(parents=True)
    (site / "__init__.py").touch()
    shutil.copy(config_files.__file__, site)
    (site / "configs" / "tiny-char.yaml").write_text("target: x\n")
    env = {k: v for k, v in os.environ.items() if k != "NEMO_SERVE_CONFIG_DIR"}
    env["PYTHONPATH"] = str(site.parent)
    # -S: no site-packages, so no editable install of this checkout either
    code = "from nemo_serve.config_files import config_dir; print(config_dir())"
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == site / "configs"


def test_config_dir_here_and_its_override(monkeypatch, tmp_path):
    monkeypatch.delenv("NEMO_SERVE_CONFIG_DIR", raising=False)
    assert (config_files.config_dir() / "tiny-char.yaml").is_file()
    assert (config_files.config_dir() / "demo_tokenizer" / "tokenizer.model").is_file()
    monkeypatch.setenv("NEMO_SERVE_CONFIG_DIR", str(tmp_path))
    assert config_files.config_dir() == tmp_path


def test_server_imports_none_of_the_builtin_weight_code():
    # model.py is where the server meets the built-ins (engine/ and server/ never name them);
    # importing it and asking about a name must not load the weight shaping.
    assert not [p for d in ("engine", "server") for p in (PACKAGE / d).glob("*.py") if "builtin" in p.read_text()]
    code = (
        "import sys, nemo_serve.cli, nemo_serve.model\n"
        "from nemo_serve import builtin\n"
        "assert not builtin.is_builtin('demo.nemo')\n"
        "print(sorted(m for m in sys.modules if m.startswith('nemo_serve.builtin.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "['nemo_serve.builtin.spec']"  # the names and their yaml only
