"""The demo diarizer's recipe: conversation corpus, DER metric, NeMo's loss on a training step.

CI does not retrain the shipped model; these check the pieces the real run relies on, on a bank of a few
espeak-ng utterances (a second of CPU) and on hand-made segments.
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from nemo_serve.training import diar_corpus
from nemo_serve.training.diar_metrics import der_counts, preds_to_segments

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng synthesizes the bank")


@pytest.fixture(scope="module")
def small_bank(tmp_path_factory):
    out = tmp_path_factory.mktemp("diar_bank")
    speakers = [s for s in diar_corpus.training_speakers(40, seed=3) if s.engine == "espeak"][:5]
    sentences = ["turn on the kitchen lights", "what time is it", "set a timer for ten minutes"]
    diar_corpus.build_bank(out, "train", speakers, sentences, per_speaker=2, workers=1)
    return diar_corpus.Bank(out / "bank_train.jsonl")


def test_heldout_speakers_share_no_voice_with_training_speakers():
    train = diar_corpus.training_speakers(300, seed=50)
    heldout = diar_corpus.heldout_speakers(seed=50)
    assert not {s.timbre for s in train} & {s.timbre for s in heldout}
    assert {s.engine for s in train} == {"espeak", "mbrola", "flite", "pico"}
    assert diar_corpus.training_speakers(300, seed=50) == train  # deterministic by seed


@needs_espeak
def test_conversations_are_deterministic_and_labelled_in_arrival_order(small_bank):
    a = diar_corpus.make_conversation(small_bank, random.Random(5), 12.0, 16.0, overlap_prob=0.5)
    b = diar_corpus.make_conversation(small_bank, random.Random(5), 12.0, 16.0, overlap_prob=0.5)
    assert np.array_equal(a.audio, b.audio) and a.segments == b.segments
    assert 12.0 <= a.duration_s <= 16.0 + 5.0
    assert 2 <= len(a.speakers) <= 4
    assert len({small_bank.timbre[n] for n in a.speakers}) == len(a.speakers)
    first_start = [min(s for k, s, _ in a.segments if k == spk) for spk in range(len(a.speakers))]
    assert first_start == sorted(first_start)  # speaker k is the k-th to speak
    targets = diar_corpus.frame_targets(a.segments, int(np.ceil(a.duration_s / 0.08)))
    assert targets[:, : len(a.speakers)].any(axis=0).all() and not targets[:, len(a.speakers):].any()
    assert (targets.sum(axis=1) >= 2).any()  # overlap_prob 0.5: someone talks over someone
    # the labels follow the audio: labelled frames are far louder than unlabelled ones
    n = len(a.audio) // 1280
    energy = np.square(a.audio[: n * 1280].reshape(n, 1280)).mean(axis=1)
    speech = targets[:n].any(axis=1)
    assert np.median(energy[speech]) > 30 * np.median(energy[~speech])


def test_rttm_round_trip(tmp_path):
    segments = [(0, 0.22, 1.8), (1, 1.5, 3.0), (0, 4.0, 4.5)]
    diar_corpus.write_rttm(tmp_path / "x.rttm", "x", segments)
    assert diar_corpus.read_rttm(tmp_path / "x.rttm") == segments


REF = [(0, 0.0, 4.0), (1, 3.0, 6.0), (2, 7.0, 9.0)]  # 9 s of speech, 1 s of it overlapped


def test_der_maps_speakers_one_to_one():
    swapped = [((k + 1) % 3, s, e) for k, s, e in REF]
    assert der_counts(REF, swapped, 10.0, collar_s=0.0).der == 0.0
    merged = [(0, s, e) for _, s, e in REF]  # one speaker for all: the two others are confusion / miss
    counts = der_counts(REF, merged, 10.0, collar_s=0.0)
    assert counts.confusion_s == pytest.approx(4.0) and counts.missed_s == pytest.approx(1.0)
    assert counts.der == pytest.approx(5.0 / 9.0)


def test_der_counts_miss_false_alarm_and_collar():
    hyp = [(0, 0.0, 4.0), (1, 3.0, 6.0), (3, 9.5, 10.0)]  # speaker 2 missed, 0.5 s of false alarm
    counts = der_counts(REF, hyp, 10.0, collar_s=0.0)
    assert (counts.missed_s, counts.false_alarm_s, counts.confusion_s) == pytest.approx((2.0, 0.5, 0.0))
    late = [(k, s + 0.2, e + 0.2) for k, s, e in REF]  # boundaries 0.2 s late: inside a 0.25 s collar
    assert der_counts(REF, late, 10.0, collar_s=0.25).der == 0.0
    # without a collar: 3 starts missed and 3 ends falsely extended by 0.2 s
    assert der_counts(REF, late, 10.0, collar_s=0.0).der == pytest.approx(6 * 0.2 / 9.0)


def test_preds_to_segments_thresholds_80ms_frames():
    preds = np.zeros((10, 4), np.float32)
    preds[2:5, 1] = 0.9
    preds[7, 1] = 0.6
    assert preds_to_segments(preds) == [(1, 0.16, 0.4), (1, 0.56, 0.64)]


@needs_espeak
def test_training_step_lowers_nemo_loss_on_one_batch(small_bank):
    """NeMo's ATS + PIL loss through our offline forward: a few steps on one batch must lower it."""
    from nemo_serve.training.diar_train import build_model, make_batch, sortformer_loss, train_forward

    torch.manual_seed(0)
    model = build_model(init_encoder=None).train()
    model.sortformer_modules.causal_attn_rate = 0.0
    audio, audio_lens, targets, target_lens = make_batch(small_bank, random.Random(1), 20.0, 8.0, 12.0)
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(6):
        loss = sortformer_loss(model, train_forward(model, audio, audio_lens, random.Random(0)), targets, target_lens)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_encoder_starts_from_the_demo_asr_model():
    """The recipe's init: the demo ASR model's encoder layers copied, its causal projection cut to 10 bins."""
    from nemo.collections.asr.models import ASRModel

    from nemo_serve.builtin.common import quiet_nemo
    from nemo_serve.training.diar_train import DEMO_ASR, build_model

    model = build_model(DEMO_ASR)
    with quiet_nemo():
        asr = ASRModel.restore_from(str(DEMO_ASR), map_location="cpu")
    for name, tensor in model.encoder.state_dict().items():
        if name != "pre_encode.out.weight" and "num_batches_tracked" not in name:
            assert torch.equal(tensor, asr.encoder.state_dict()[name].float()), name
    ours, theirs = model.encoder.pre_encode.out.weight.detach(), asr.encoder.pre_encode.out.weight.detach().float()
    assert torch.equal(ours.reshape(128, 96, 10), theirs.reshape(128, 96, 11)[:, :, :10])


def test_training_continues_from_the_shipped_weights():
    """--init-from: a run whose last.pt is gone starts from the shipped .nemo (fp16 parameters) in fp32."""
    from nemo_serve.builtin.sortformer import DEMO_DIARIZER_PATH, build_diarizer
    from nemo_serve.training.diar_train import build_model, load_trained_weights

    model = build_model(init_encoder=None)
    shipped = build_diarizer("demo-sortformer").state_dict()
    assert not torch.equal(model.state_dict()["sortformer_modules.single_hidden_to_spks.weight"],
                           shipped["sortformer_modules.single_hidden_to_spks.weight"])
    load_trained_weights(model, DEMO_DIARIZER_PATH)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == shipped[name].dtype and torch.equal(tensor, shipped[name]), name
    assert all(p.dtype == torch.float32 for p in model.parameters())
