"""Where the model configs shipped in configs/ are: the built-in architectures, the demo model's recipe and tokenizer.

An installed package carries them as the package data `nemo_serve.configs` (pyproject.toml maps
the top-level configs/ folder there); a source checkout used without installing reads the
configs/ folder next to the package. NEMO_SERVE_CONFIG_DIR names another folder.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def config_dir() -> Path:
    override = os.environ.get("NEMO_SERVE_CONFIG_DIR")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("nemo_serve.configs")  # a folder of data files: a namespace package
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / "configs"
