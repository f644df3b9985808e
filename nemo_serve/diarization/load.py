"""Loading the diarizer served beside the ASR model (--diarizer): builtin:NAME or a .nemo file.

A .nemo is one of NVIDIA's streaming Sortformer checkpoints (diar_streaming_sortformer_4spk-v2 and
kin, `SortformerEncLabelModel`), restored, put in eval and streaming mode with NeMo's async update,
and given the model card's low-latency setting (1.04 s), the one NeMo's voice agent uses.
"""

from __future__ import annotations

from pathlib import Path

from .settings import MODEL_CARD_SETTINGS, apply_settings

DEFAULT_SETTING = "low"


def load_diarizer(spec: str, device: str = "cpu"):
    """The diarizer `spec` names, on `device`; ValueError / FileNotFoundError for what the user can fix."""
    import torch

    if spec.startswith("builtin:"):
        from ..builtin.sortformer import build_diarizer

        model = build_diarizer(spec.removeprefix("builtin:"))
    else:
        path = Path(spec)
        if path.suffix != ".nemo":
            raise ValueError(f"--diarizer {spec!r}: give builtin:tiny-sortformer or a streaming Sortformer .nemo file")
        if not path.exists():
            raise FileNotFoundError(f"--diarizer {spec}: no such file")
        from nemo.collections.asr.models import SortformerEncLabelModel

        model = SortformerEncLabelModel.restore_from(str(path), map_location="cpu")
    model = model.to(device=device, dtype=torch.float32).eval()
    model.streaming_mode = True
    model.async_streaming = True  # the update diarization/update.py reproduces
    apply_settings(model, MODEL_CARD_SETTINGS[DEFAULT_SETTING])
    return model
