"""Feature-domain augmentation for the recipe: random equalisation and vocal-tract length perturbation
(VTLP), both applied on the mel power the log features came from."""

from __future__ import annotations

import numpy as np
import torch

from ..nemo_private import preprocessor_sample_rate

# AudioToMelSpectrogramPreprocessor's default log_zero_guard_value (log_zero_guard_type "add")
LOG_GUARD = 2.0 ** -24


def random_eq(feats: torch.Tensor, lens: torch.Tensor, rng: np.random.Generator, max_db: float,
              points: int = 6, prob: float = 0.8) -> torch.Tensor:
    """A random microphone and room per item: the mel power of a share ``prob`` of the items is multiplied
    by a smooth gain curve (``points`` control points evenly spread over the mel axis, each uniform in
    +-max_db, joined linearly, the curve's mean removed so the level is left to the corpus's gain).  It
    works on power, not on the log, so digital silence stays at the log floor, and frames past an item's
    length are left alone.  A voice recorded through another channel differs mostly this way: matching the
    held-out flite voice's mean log-mel to the training voices' alone took its offline WER from 38% to 26%
    (docs/demo_model.md)."""
    grid = np.linspace(0, points - 1, feats.shape[1])

    def channel(power: torch.Tensor) -> torch.Tensor:
        db = np.interp(grid, np.arange(points), rng.uniform(-max_db, max_db, points))
        return power * torch.from_numpy(10.0 ** ((db - db.mean()) / 10.0)).to(power.dtype)[:, None]

    return _on_power(feats, lens, rng, prob, channel)


def _on_power(feats: torch.Tensor, lens: torch.Tensor, rng: np.random.Generator, prob: float, transform) -> torch.Tensor:
    """Log-mels with `transform` ([bands, frames] mel power -> the same) applied to a share ``prob`` of the
    items, on power so digital silence stays at the log floor; frames past an item's length are left alone."""
    out = feats.clone()
    for i in range(feats.shape[0]):
        if rng.random() >= prob:
            continue
        n = int(lens[i])
        power = (feats[i, :, :n].exp() - LOG_GUARD).clamp_min(0.0)
        out[i, :, :n] = torch.log(transform(power) + LOG_GUARD)
    return out


def mel_centers_hz(preprocessor) -> np.ndarray:
    """Each mel filter's centre frequency (its weighted mean), from the preprocessor's own filterbank."""
    fb = preprocessor.featurizer.fb[0].detach().double().cpu().numpy()  # [n_mels, n_fft // 2 + 1]
    freqs = np.linspace(0.0, preprocessor_sample_rate(preprocessor) / 2, fb.shape[1])
    return (fb * freqs).sum(1) / fb.sum(1)


def random_vtlp(feats: torch.Tensor, lens: torch.Tensor, rng: np.random.Generator, max_warp: float,
                centers_hz: np.ndarray, prob: float = 0.8) -> torch.Tensor:
    """Vocal tract length perturbation on the features: for a share ``prob`` of the items, a factor a
    uniform in 1 +- max_warp moves every spectral feature from frequency f to a * f (formants up for
    a > 1, as a shorter vocal tract has them).  Output band i reads the input's mel power at
    centers_hz[i] / a, interpolated linearly between bands (the band edge repeats past either end).
    On power, not on the log, so digital silence stays at the log floor; frames past an item's length
    are left alone.  A pseudo-speaker per item from every voice, as flite's --flite-warp makes per
    utterance at synthesis, but for espeak-ng and festival too."""
    return _on_power(feats, lens, rng, prob,
                     lambda power: warp_bands(power, rng.uniform(1.0 - max_warp, 1.0 + max_warp), centers_hz))


def warp_bands(power: torch.Tensor, a: float, centers_hz: np.ndarray) -> torch.Tensor:
    """[bands, frames] mel power with every feature moved from frequency f to a * f (random_vtlp)."""
    bands = np.arange(len(centers_hz), dtype=np.float64)
    src = np.interp(centers_hz / a, centers_hz, bands)  # fractional input band per output band
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, len(bands) - 1)
    w = torch.from_numpy(src - lo).to(power.dtype)[:, None]
    return power[torch.from_numpy(lo)] * (1 - w) + power[torch.from_numpy(hi)] * w
