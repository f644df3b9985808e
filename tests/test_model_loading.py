"""Model loading: .nemo, pretrained names offline, built-ins, and the start-up summary."""

import pytest
import torch

from nemo_serve.model import ModelLoadError, load_model

from . import helpers


def test_pretrained_name_offline_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        load_model("nvidia/nemotron-speech-streaming-en-0.6b")
    msg = str(e.value)
    assert "\n" not in msg and "nemotron-speech-streaming" in msg and ".nemo" in msg


def test_missing_file_is_one_clear_line():
    with pytest.raises(ModelLoadError, match="not found"):
        load_model("/nonexistent/model.nemo")


def test_restore_from_local_nemo_equals_builtin(tmp_path):
    m = helpers.model("builtin:tiny-hybrid", None)
    path = tmp_path / "tiny.nemo"
    m.nemo.save_to(str(path))
    again = load_model(str(path))
    assert again.trained_context_right == m.trained_context_right
    assert again.cache_shapes == m.cache_shapes
    assert again.vocabulary == m.vocabulary
    original, restored = m.nemo.state_dict(), again.nemo.state_dict()
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[k], original[k]) for k in original)


def test_summary_names_chunk_cache_and_slots():
    m = helpers.model("builtin:tiny-char", 0)
    s = m.summary(16)
    assert "chunk 80 ms" in s and "x 16 slots" in s and "MiB/stream" in s
