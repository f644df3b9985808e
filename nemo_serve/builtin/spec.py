"""The built-in architectures by name, and each one's yaml (configs/). Light: no torch, no NeMo."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ..config_files import config_dir

BUILTIN_NAMES = ("tiny-char", "tiny-hybrid", "tiny-prompt", "tiny-eou", "fastconformer-l", "nemotron-0.6b")


def is_builtin(name: str) -> bool:
    return name in BUILTIN_NAMES


def builtin_spec(name: str) -> DictConfig:
    """The whole yaml of a built-in: `target`, `model`, and our `tokenizer` / `random_init` recipes."""
    if not is_builtin(name):
        raise ValueError(f"unknown built-in model {name!r}; choose one of: {', '.join(BUILTIN_NAMES)}")
    path = config_dir() / f"{name}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"built-in config {path} is missing (NEMO_SERVE_CONFIG_DIR names the configs/ folder)")
    return OmegaConf.load(path)
