"""Build a built-in: construct the NeMo model from its config with a seeded init, then shape its weights.

The same name and seed give the same weights with the same torch and NeMo on the same machine,
whatever the caller's thread count; other CPUs may differ in the last bits of the calibration
and so, rarely, in a decision: ship a .nemo (save_to) when two machines must agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging

import torch
from omegaconf import OmegaConf, open_dict

from .spec import builtin_spec
from .common import phase, quiet_nemo
from .tokenizer import ensure_tokenizer
from .weights import RandomInitRecipe, shape_weights

log = logging.getLogger(__name__)


def build(name: str, seed: int = 0):
    """Build the named architecture with seeded, non-degenerate random weights (eval mode, CPU, fp32)."""
    timings: dict[str, float] = {}
    with phase(timings, "total"):
        spec = builtin_spec(name)
        cfg = spec.model.copy()
        if "tokenizer" in spec:
            with phase(timings, "tokenizer"), open_dict(cfg):
                cfg.tokenizer.dir = str(ensure_tokenizer(name, spec.tokenizer))
                cfg.tokenizer.type = spec.tokenizer.type
        cls = _import_class(spec.target)
        with phase(timings, "construct"), quiet_nemo(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(cfg=cfg)
        model = model.to(device="cpu", dtype=torch.float32).eval()
        recipe = RandomInitRecipe(**OmegaConf.to_container(spec.get("random_init", {})))
        gen = torch.Generator().manual_seed(_derived_seed(name, seed))
        # One thread: the calibration's float results (and so the weights) must not depend on the
        # caller's thread count, or a server and a test process would build different models.
        with torch.no_grad(), quiet_nemo(), _torch_threads(1):
            shape_weights(model, recipe, gen, timings)
    num_params = sum(p.numel() for p in model.parameters())
    log.info(
        "built %s (seed %d): %.1fM parameters in %.1f s (%s)", name, seed, num_params / 1e6, timings["total"],
        ", ".join(f"{k} {v:.1f}" for k, v in timings.items() if k != "total"),
    )
    return model


def _derived_seed(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}:{seed}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def _import_class(path: str):
    module, _, cls = path.rpartition(".")
    return getattr(importlib.import_module(module), cls)


@contextlib.contextmanager
def _torch_threads(num: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
