"""The built-in random-weight streaming Sortformer and the NeMo reference loop (the oracle).

The head calibration must make the speaker-cache logic branch: some frames active for one speaker,
some silent for all (they feed the mean silence embedding), some overlapped. Audio seeds here are
small; the calibration's is 0xD1A2.
"""

from __future__ import annotations

import functools

import pytest
import torch

from nemo_serve.builtin.sortformer import build_diarizer
from nemo_serve.diarization.reference import nemo_chunks, nemo_reference_preds, stream_features
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings
from nemo_serve.synth import synth_audio


@functools.lru_cache(maxsize=None)
def built(seed: int = 0):
    return build_diarizer("tiny-sortformer", seed)


def _offline_preds(model, seconds: float, audio_seed: int) -> torch.Tensor:
    audio = synth_audio(seconds, audio_seed)
    with torch.no_grad():
        features, lengths = model.process_signal(audio.unsqueeze(0), torch.tensor([audio.numel()]))
        embs, emb_lengths = model.frontend_encoder(features, lengths)
        return model.forward_infer(embs, emb_lengths)[0]


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = built(0), build_diarizer("tiny-sortformer", 0), built(1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.sortformer_modules.single_hidden_to_spks.weight, c.sortformer_modules.single_hidden_to_spks.weight)


def test_speaker_head_makes_speech_silence_and_overlap():
    preds = _offline_preds(built(), 20.0, audio_seed=3)  # [T, K]
    active = preds > 0.5
    assert ((active.float().mean(dim=0) > 0.03) & (active.float().mean(dim=0) < 0.6)).all(), active.float().mean(dim=0)
    assert 0.01 < (preds.sum(dim=1) < 0.2).float().mean() < 0.3  # silent frames: the silence profile moves
    assert (active.sum(dim=1) > 1).float().mean() > 0.03  # overlap


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="tiny-sortformer"):
        build_diarizer("tiny-char")


@pytest.mark.parametrize("setting", ["low", "ultra_low"])
def test_reference_loop_is_nemos_forward_streaming(setting):
    """The helper drives forward_streaming_step exactly as NeMo's own whole-utterance streaming forward does."""
    model = built()
    apply_settings(model, MODEL_CARD_SETTINGS[setting])
    features = stream_features(model, synth_audio(6.0, 4))
    ours = nemo_reference_preds(model, nemo_chunks(model, features))
    with torch.no_grad():
        theirs = model.forward_streaming(features.unsqueeze(0), torch.tensor([features.shape[1]]))[0]
    assert ours.shape == theirs.shape and ours.shape[0] == (features.shape[1] + 7) // 8
    assert torch.equal(ours, theirs)
