"""The demo EOU model's recipe (nemo_serve/training/eou.py): the vocabulary grown by <EOU> keeps every
old id, and the grown model starts as the demo model with <EOU> a less likely blank."""

from __future__ import annotations

import torch

from nemo_serve.config_files import config_dir
from nemo_serve.training import model_setup
from nemo_serve.training.eou import EOU_BIAS_OFFSET, grow_tokenizer, strip_eou

DEMO = "nemo_serve/assets/demo/demo.nemo"


def test_grown_tokenizer_keeps_old_ids_and_appends_eou(tmp_path):
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

    old = SentencePieceTokenizer(str(config_dir() / "demo_tokenizer" / "tokenizer.model"))
    grown = SentencePieceTokenizer(str(grow_tokenizer(config_dir() / "demo_tokenizer", tmp_path) / "tokenizer.model"))
    text = "set a timer for ten minutes on tuesday the third"
    assert grown.text_to_ids(text) == old.text_to_ids(text)
    assert grown.vocab_size == old.vocab_size + 1 and grown.token_to_id("<EOU>") == old.vocab_size
    assert strip_eou(grown.ids_to_text(grown.text_to_ids(text) + [old.vocab_size])) == text


def test_grown_model_starts_as_the_demo_model_with_eou_below_blank(tmp_path):
    from nemo.collections.asr.models import ASRModel

    demo = ASRModel.restore_from(DEMO, map_location="cpu").eval()
    tok = grow_tokenizer(config_dir() / "demo_tokenizer", tmp_path / "tok")
    grown = model_setup.build_model(model_setup.DEFAULT_CONFIG, tok, len(demo.encoder.layers))
    model_setup.init_from(grown, DEMO)  # refused (vocabulary mismatch) before the EOU recipe
    grown.eval()
    v = demo.tokenizer.vocab_size
    enc = torch.randn(2, 7, demo.joint.enc.in_features if hasattr(demo.joint.enc, "in_features") else 128)
    g = torch.randn(2, 3, demo.joint.pred.in_features)
    with torch.no_grad():
        old = demo.joint.joint(enc, g)  # [B, T, U, V+1]
        new = grown.joint.joint(enc, g)  # [B, T, U, V+2]
    # (log-probabilities: compared as differences to the blank, which the extra class leaves alone)
    old_rel, new_rel = old[..., :v] - old[..., v : v + 1], new[..., :v] - new[..., v + 1 : v + 2]
    assert torch.allclose(new_rel, old_rel, atol=1e-4)
    assert torch.allclose(new[..., v] - new[..., v + 1], torch.full_like(new[..., v], -EOU_BIAS_OFFSET), atol=1e-4)


def test_multi_turn_examples_put_one_eou_after_each_turn_and_silence_between(tmp_path):
    """Issue 49: a model trained on one utterance per example said nothing after its first <EOU>. The
    train_turns split (eou_corpus) holds 2-3 turns of one voice with 0.3-1.5 s of silence between them,
    and the training target has one <EOU> after each turn's words, in order."""
    import json
    import random

    import numpy as np
    import soundfile as sf
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

    from nemo_serve.training import eou_corpus
    from nemo_serve.training.eou import eou_token_ids

    tok = SentencePieceTokenizer(str(grow_tokenizer(config_dir() / "demo_tokenizer", tmp_path / "tok") / "tokenizer.model"))
    eou = tok.token_to_id("<EOU>")
    turns = ["set a timer for ten minutes", "what is the weather on monday", "call mom"]
    text = eou_corpus.turns_text(turns)
    assert text.count("<EOU>") == 3 and strip_eou(text) == " ".join(turns)
    expected = sum((tok.text_to_ids(t) + [eou] for t in turns), [])
    assert eou_token_ids(tok, text, eou) == expected
    assert eou_token_ids(tok, turns[0], eou) == tok.text_to_ids(turns[0]) + [eou]  # single-turn: as before

    # one sentence per turn, in order; every example's sentences consecutive; about half multi-turn
    groups = eou_corpus.group_turns(400, random.Random(7), 0.5)
    assert sum(groups, []) == list(range(400)) and {len(g) for g in groups} == {1, 2, 3}
    assert 0.35 < sum(len(g) > 1 for g in groups) / len(groups) < 0.65
    assert groups == eou_corpus.group_turns(400, random.Random(7), 0.5)  # deterministic by seed

    # join_turns: the turns in order, exactly, with the asked silence between them
    waves = [np.full(n, v, np.float32) for n, v in ((5, 1.0), (7, 2.0), (3, 3.0))]
    joined, spans = eou_corpus.join_turns(waves, [4, 6])
    assert spans == [(0, 5), (9, 16), (22, 25)]
    assert joined.tolist() == [1.0] * 5 + [0.0] * 4 + [2.0] * 7 + [0.0] * 6 + [3.0] * 3

    # a synthesized split: 3-turn examples of one voice; the file is those turns' speech, in order, with
    # the recorded gaps (0.3-1.5 s), behind corpus.augment's lead silence (0.05-0.5 s), before its tail
    rows = eou_corpus.build_turns_split("t", turns, tmp_path, seed=5, workers=1, share=1.0)  # seed 5: one 3-turn example
    assert rows == [json.loads(line) for line in open(tmp_path / "t.jsonl")]
    (row,) = rows
    assert row["turns"] == 3 and row["text"] == text and all(0.3 <= g <= 1.5 for g in row["gaps_s"])
    audio, sr = sf.read(tmp_path / row["audio_filepath"], dtype="float32")
    speech = [eou_corpus._speech(t, row["voice"], row["rate"], row["pitch"]) for t in turns]
    joined, spans = eou_corpus.join_turns(speech, [round(g * sr) for g in row["gaps_s"]])
    assert 0.15 * sr <= len(audio) - len(joined) <= 1.0 * sr
    best = max(range(int(0.05 * sr), int(0.5 * sr) + 1),
               key=lambda lead: float(np.dot(audio[lead: lead + len(joined)], joined)))
    placed = audio[best: best + len(joined)]
    assert np.corrcoef(placed, joined)[0, 1] > 0.7  # the turns, in this order, at these gaps (0.83 seen)
    rms = lambda x: float(np.sqrt(np.mean(x**2)))  # noqa: E731
    for (a, end), (start, b) in zip(spans, spans[1:]):  # the gaps hold only noise (SNR >= 15 dB)
        assert rms(placed[end + 160: start - 160]) < 0.3 * min(rms(placed[a:end]), rms(placed[start:b]))


def test_train_turns_split_leaves_the_other_splits_and_shares_no_sentence(tmp_path, monkeypatch):
    """eou_corpus --n-train-turns draws its sentences after every other split: those stay as drawn
    without it, and no turn is a held-out or training sentence. Synthesis stubbed."""
    from nemo_serve.training import eou_corpus

    def recorder(calls: dict):
        def build(name, sentences, *args, **kwargs):
            calls[name] = list(sentences)
            return []

        return build

    plain, with_turns = {}, {}
    monkeypatch.setattr(eou_corpus, "build_split", recorder(plain))
    eou_corpus.main(["--out", str(tmp_path / "a"), "--n-train", "30", "--n-eval", "6", "--workers", "1"])
    monkeypatch.setattr(eou_corpus, "build_split", recorder(with_turns))
    monkeypatch.setattr(eou_corpus, "build_turns_split", recorder(with_turns))
    eou_corpus.main(["--out", str(tmp_path / "b"), "--n-train", "30", "--n-eval", "6", "--n-train-turns", "20",
                     "--workers", "1"])
    turns = with_turns.pop("train_turns")
    assert with_turns == plain and len(turns) == 20
    assert not set(turns) & set(sum(plain.values(), []))
