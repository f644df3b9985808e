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
