"""The device's state after a CUDA graph capture failed, put back for what runs next: needed by the
step (engine/step.py, NeMo's decoder graphs) and by the encoder's graphs (engine/cuda_graphs.py).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("nemo_serve.engine")


def restore_device_state(device: torch.device) -> None:
    """After a failed capture: wait for the device (an error of the failed work surfaces here and is
    logged) and make the default stream current again (a failure inside NeMo's while-loop body
    leaves the body's stream current, and the next capture would then end on the wrong stream)."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - logged; the caller retries in a simpler mode
        log.exception("synchronize after a failed capture")
    torch.cuda.set_stream(torch.cuda.default_stream(device))
