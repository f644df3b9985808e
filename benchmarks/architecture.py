"""A built-in architecture as a ServedModel, constructed from its config with NeMo's random init and
nothing else: no weight calibration (Nemotron's takes ~25 min on 2 cores), no download.

For what depends only on shapes: memory per stream (benchmarks/memory_table.py) and operators per
step (benchmarks/kernel_count.py). The weights emit tokens at whatever rate random init gives, so
decoder work per step is not Nemotron's; the counts say which part is the decoder.
"""

from __future__ import annotations

import functools
from unittest import mock

import torch
from omegaconf import open_dict


@functools.lru_cache(maxsize=2)
def construct(name: str, seed: int = 0):
    """The NeMo model of configs/NAME.yaml, random init, fp32, CPU, eval."""
    from nemo_serve.builtin import builtin_spec
    from nemo_serve.builtin.build import _import_class
    from nemo_serve.builtin.common import quiet_nemo
    from nemo_serve.builtin.tokenizer import ensure_tokenizer

    spec = builtin_spec(name)
    cfg = spec.model.copy()
    if "tokenizer" in spec:
        with open_dict(cfg):
            cfg.tokenizer.dir = str(ensure_tokenizer(name, spec.tokenizer))
            cfg.tokenizer.type = spec.tokenizer.type
    cls = _import_class(spec.target)
    with quiet_nemo(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg=cfg)
    return model.to(device="cpu", dtype=torch.float32).eval()


def served(name: str, context_right: int | None, dtype: str = "fp32", device: str = "cpu"):
    """`load_model` on the constructed (uncalibrated) model at one mode, dtype and device. The NeMo
    model is shared between calls (load_model sets the mode and casts it in place): a ServedModel of
    another mode needs its mode set again (`set_mode`) before it steps."""
    from nemo_serve import model as model_mod

    nemo = construct(name)
    with mock.patch.object(model_mod, "_load_nemo", lambda spec, dev: (nemo.to(dev), f"builtin:{name} (uncalibrated)")):
        return model_mod.load_model(f"builtin:{name}", context_right=context_right, dtype=dtype, device=device)


def set_mode(model) -> None:
    """Make `model`'s mode the shared NeMo model's current one."""
    g = model.geometry
    model.nemo.encoder.set_default_att_context_size([g.context_left, g.context_right])
