"""The stand-in model geometry the in-process ring and packet-path tests build a front end's client on."""

from __future__ import annotations

from nemo_serve.engine.geometry import ChunkGeometry, ModelInfo


def ring_model_info() -> ModelInfo:
    g = ChunkGeometry(context_left=56, context_right=3, first_frames=25, chunk_frames=32, pre_cache_frames=9,
                      drop_frames=2, min_first_frames=1, min_later_frames=8, hop_samples=160, sample_rate=16000,
                      subsampling=8)  # fmt: skip
    return ModelInfo(name="m", geometry=g, vocabulary=[], is_bpe=True, prompt_dictionary=None,
                     default_language=None, feature_margin=240, summary="")  # fmt: skip
