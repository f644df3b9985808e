"""What the weight-shaping modules share: seeded draws, the <unk> token, timing and NeMo's log level."""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

UNK_LOGIT = -40.0  # <unk> never wins


def randn(gen: torch.Generator, shape) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen)


def randn64(gen: torch.Generator, shape) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def unk_id(model) -> Optional[int]:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return None
    unk = tokenizer.tokenizer.unk_id()
    return unk if unk >= 0 else None


@contextlib.contextmanager
def phase(timings: dict, name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - start


@contextlib.contextmanager
def quiet_nemo():
    from nemo.utils import logging as nemo_logging

    with nemo_logging.temp_verbosity(nemo_logging.ERROR):
        yield
