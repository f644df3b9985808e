"""The built-in streaming Sortformer diarizers: `tiny-sortformer` (NVIDIA's layout at toy width, seeded
random weights) and `demo-sortformer` (the trained demo diarizer shipped in assets/demo, no download).

Kept apart from spec.py's BUILTIN_NAMES on purpose: those are ASR models the server and its tests
build by name, and a diarizer is not one of them until the engine has a model-runner interface.

With NeMo's random init every speaker sigmoid sits near 0.5 on every frame: no frame is silent,
every frame is "speech" for every speaker, and the speaker cache's choices (silence profile,
positive scores, top-k per speaker) hardly branch. So the speaker head is rescaled on calibration
audio so that each speaker's logit has a chosen mean and spread: then frames are active for some
speakers, silent for all (sum below sil_threshold) or overlapped, and a runtime that gets the
cache bookkeeping wrong diverges from NeMo's loop within a few chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ..config_files import config_dir
from ..synth import SAMPLE_RATE, synth_audio
from .common import quiet_nemo

DIARIZER_NAMES = ("tiny-sortformer", "demo-sortformer")
# Trained by nemo_serve.training.diar_train on the project's synthetic conversations (docs/diarization.md).
DEMO_DIARIZER_PATH = Path(__file__).resolve().parents[1] / "assets" / "demo" / "demo_sortformer.nemo"
_CALIBRATION_AUDIO_SEED = 0xD1A2  # far from the small seeds tests use for their own audio


@dataclass
class HeadRecipe:
    """Target statistics of each speaker's logit on calibration audio (a config's `random_init`)."""

    logit_mean: float = -2.5
    logit_std: float = 3.0
    calibration_seconds: float = 24.0


def diarizer_spec(name: str) -> DictConfig:
    if name not in DIARIZER_NAMES:
        raise ValueError(f"unknown built-in diarizer {name!r}; choose one of: {', '.join(DIARIZER_NAMES)}")
    return OmegaConf.load(config_dir() / f"{name}.yaml")


def build_diarizer(name: str = "tiny-sortformer", seed: int = 0):
    """SortformerEncLabelModel (eval, CPU, fp32): `demo-sortformer`'s trained weights (seed unused), or
    `tiny-sortformer` with seeded random weights and a calibrated speaker head."""
    from nemo.collections.asr.models import SortformerEncLabelModel

    if name == "demo-sortformer":
        if not DEMO_DIARIZER_PATH.exists():
            raise FileNotFoundError(f"{DEMO_DIARIZER_PATH} is not there: train and ship it (docs/diarization.md)")
        with quiet_nemo():  # parameters are stored as fp16 (ship.shrink_nemo): computed in fp32
            model = SortformerEncLabelModel.restore_from(str(DEMO_DIARIZER_PATH), map_location="cpu")
        return model.to(dtype=torch.float32).eval()
    spec = diarizer_spec(name)
    with quiet_nemo(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SortformerEncLabelModel(cfg=spec.model.copy())
    model = model.to(device="cpu", dtype=torch.float32).eval()
    recipe = HeadRecipe(**OmegaConf.to_container(spec.get("random_init", {})))
    with torch.no_grad():
        _calibrate_speaker_head(model, recipe)
    return model


def _calibrate_speaker_head(model, recipe: HeadRecipe) -> None:
    """Affine-rescale each speaker's output unit to logit_mean +- logit_std on calibration audio."""
    head = model.sortformer_modules.single_hidden_to_spks
    audio = synth_audio(recipe.calibration_seconds, _CALIBRATION_AUDIO_SEED, SAMPLE_RATE)
    logits = _speaker_logits(model, audio)  # [T, K]
    mean, std = logits.mean(dim=0), logits.std(dim=0).clamp(min=1e-6)
    gain = recipe.logit_std / std  # [K]
    head.weight.mul_(gain.unsqueeze(1))
    head.bias.copy_((head.bias - mean) * gain + recipe.logit_mean)


def _speaker_logits(model, audio: torch.Tensor) -> torch.Tensor:
    """Pre-sigmoid speaker logits [T, K] of the whole utterance, offline (no speaker cache)."""
    features, feature_lengths = model.process_signal(audio.unsqueeze(0), torch.tensor([audio.numel()]))
    embs, emb_lengths = model.frontend_encoder(features, feature_lengths)
    mask = model.sortformer_modules.length_to_mask(emb_lengths, embs.shape[1])
    hidden = model.transformer_encoder(encoder_states=embs, encoder_mask=mask)
    modules = model.sortformer_modules
    hidden = modules.first_hidden_to_hidden(torch.relu(hidden))
    return modules.single_hidden_to_spks(torch.relu(hidden))[0]
