"""The demo diarizer's recipe options: the weight average (--ema) and the speaker-count mix (--speaker-counts).

A bank of a few espeak-ng utterances (seconds of CPU) and a two-layer stand-in module for the average.
"""

from __future__ import annotations

import json
import math
import random
import shutil

import numpy as np
import pytest
import torch

from nemo_serve.training import diar_corpus
from nemo_serve.training.diar_train import WeightEma, make_batch

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng synthesizes the bank")


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A training bank of 5 espeak-ng speakers (5 timbres) and one dev conversation, as diar_corpus lays out."""
    out = tmp_path_factory.mktemp("diar_corpus")
    speakers = [s for s in diar_corpus.training_speakers(60, seed=3) if s.engine == "espeak"]
    distinct = list({s.timbre: s for s in speakers}.values())[:5]
    sentences = ["turn on the kitchen lights", "what time is it", "set a timer for ten minutes"]
    diar_corpus.build_bank(out, "train", distinct, sentences, per_speaker=2, workers=1)
    bank = diar_corpus.Bank(out / "bank_train.jsonl")
    diar_corpus.write_conversations(out, "dev", bank, 1, seed=4, min_s=6.0, max_s=8.0)
    return out, bank


def _stand_in():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def _fill(module, value: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)


def test_ema_halves_its_distance_to_steady_weights_every_half_life():
    """The documented half-life: ln 0.5 / ln decay steps halve the gap between the average and fixed weights."""
    model = _stand_in()
    _fill(model, 0.0)
    ema = WeightEma(model, decay=0.9)
    _fill(model, 1.0)
    half_life = math.log(0.5) / math.log(0.9)  # 6.58 steps
    for _ in range(20):
        ema.update(model)
    gap = 1.0 - ema.state["0.weight"]
    assert torch.allclose(gap, torch.full_like(gap, 0.5 ** (20 / half_life)), atol=1e-6)
    assert 0.0 < float(gap.max()) < 0.2  # moved toward the trained weights, not onto them


def test_ema_is_applied_for_evaluation_and_the_trained_weights_come_back():
    model = _stand_in()
    _fill(model, 0.0)
    ema = WeightEma(model, decay=0.5)
    _fill(model, 1.0)
    model(torch.randn(5, 3))  # the BatchNorm's counter and running stats move
    ema.update(model)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.applied(model):
        assert torch.equal(model[0].weight, torch.full((4, 3), 0.5))  # between the start and the trained
        assert int(model[1].num_batches_tracked) == 1  # counters: the latest, not averaged
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    _fill(model, 7.0)  # training goes on: the average is a copy, not a view of the weights
    assert torch.equal(ema.state["0.weight"], torch.full((4, 3), 0.5))


def test_ema_refuses_a_decay_outside_zero_to_one():
    with pytest.raises(ValueError, match="decay"):
        WeightEma(_stand_in(), decay=1.0)


def _speakers_per_conversation(targets, target_lens) -> list[int]:
    return [int((targets[i, : int(n)].amax(0) > 0).sum()) for i, n in enumerate(target_lens)]


@needs_espeak
def test_speaker_counts_choose_how_many_speakers_each_conversation_has(small_corpus):
    _, bank = small_corpus
    _, _, targets, lens = make_batch(bank, random.Random(1), 120.0, 14.0, 18.0, speaker_counts=(4,))
    assert len(lens) >= 6 and set(_speakers_per_conversation(targets, lens)) == {4}
    _, _, targets, lens = make_batch(bank, random.Random(1), 120.0, 14.0, 18.0, speaker_counts=(2, 3))
    assert set(_speakers_per_conversation(targets, lens)) == {2, 3}
    _, _, targets, lens = make_batch(bank, random.Random(1), 120.0, 14.0, 18.0)  # default: 2-4, as before
    assert set(_speakers_per_conversation(targets, lens)) == {2, 3, 4}


@needs_espeak
def test_training_with_ema_evaluates_and_saves_the_average(small_corpus, tmp_path):
    """--ema: ema.nemo holds the average kept in last.pt, not the last trained weights."""
    from nemo.collections.asr.models import SortformerEncLabelModel

    from nemo_serve.builtin.common import quiet_nemo
    from nemo_serve.training.diar_train import main

    data, _ = small_corpus
    main(["--data", str(data), "--out", str(tmp_path), "--steps", "2", "--eval-every", "2", "--batch-s", "8",
          "--min-s", "6", "--max-s", "8", "--warmup", "1", "--lr", "1e-3", "--ema", "0.5", "--no-init",
          "--speaker-counts", "2,3"])
    last = torch.load(tmp_path / "last.pt", weights_only=False)
    with quiet_nemo():
        saved = SortformerEncLabelModel.restore_from(str(tmp_path / "ema.nemo"), map_location="cpu").state_dict()
    key = "sortformer_modules.single_hidden_to_spks.weight"
    assert torch.equal(saved[key], last["ema"][key])
    assert not torch.equal(saved[key], last["model"][key])


def test_a_logit_offset_in_the_head_decides_at_half_as_the_model_did_at_the_lower_threshold():
    """diar_calibrate's premise: bias + b at p > 0.5 equals the unshifted model at p > sigmoid(-b)."""
    from nemo_serve.training.diar_calibrate import shift_speaker_logits, threshold_for
    from nemo_serve.training.diar_eval import offline_preds
    from nemo_serve.training.diar_train import build_model

    torch.manual_seed(0)
    model = build_model(init_encoder=None).eval()
    audio = 0.1 * torch.randn(4 * 16000)
    before = offline_preds(model, audio)
    shift_speaker_logits(model, 0.3)
    after = offline_preds(model, audio)
    assert torch.equal(after > 0.5, before > threshold_for(0.3))
    assert int((after > 0.5).sum()) > int((before > 0.5).sum())  # the shift did move decisions


def _one_speaker(p_speech: float, p_silence: float):
    """Speaker 0 speaks 0-4 s of 6 s; preds [75 frames of 80 ms, 4]: p_speech there, p_silence elsewhere."""
    preds = np.full((75, 4), 0.05, np.float32)
    preds[:, 0] = p_silence
    preds[:50, 0] = p_speech
    return [preds], [(None, [(0, 0.0, 4.0)], 6.0)]


def test_the_offset_is_the_smallest_one_with_the_lowest_dev_der():
    from nemo_serve.training.diar_calibrate import best_offset, der_at_offsets

    cautious = der_at_offsets(*_one_speaker(0.45, 0.05))  # all speech missed at 0.5
    assert cautious[0.0].der == 1.0 and best_offset(cautious) == 0.25  # 0.2 -> 0.4502, still above 0.45
    confident = der_at_offsets(*_one_speaker(0.6, 0.45))  # right at 0.5; a shift of 0.25 adds false alarm
    assert confident[0.0].der == 0.0 and confident[0.25].false_alarm_s > 0 and best_offset(confident) == 0.0


@needs_espeak
def test_calibration_saves_the_chosen_offset_in_the_head(small_corpus, tmp_path, capsys):
    from nemo_serve.training.diar_calibrate import main
    from nemo_serve.training.diar_eval import load_model
    from nemo_serve.training.diar_train import build_model

    data, _ = small_corpus
    torch.manual_seed(0)
    build_model(init_encoder=None).save_to(str(tmp_path / "in.nemo"))
    main(["--model", str(tmp_path / "in.nemo"), "--data", str(data), "--out", str(tmp_path / "out.nemo"),
          "--offsets", "0.3", "--report", str(tmp_path / "report.json")])  # one candidate: a random model's
    # dev DER may well choose no shift
    bias_in = load_model(str(tmp_path / "in.nemo")).sortformer_modules.single_hidden_to_spks.bias
    bias_out = load_model(str(tmp_path / "out.nemo")).sortformer_modules.single_hidden_to_spks.bias
    chosen = float(capsys.readouterr().out.split("logit offset ")[1].split()[0])
    shift = (bias_out - bias_in).detach()
    assert chosen == 0.3
    assert torch.allclose(shift, torch.full_like(shift, chosen), atol=1e-6)  # one offset for all speakers
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["chosen_logit_offset"] == 0.3 and list(report["dev_der_no_collar"]) == ["0.3"]
    assert "--offsets 0.3" in report["command"]
