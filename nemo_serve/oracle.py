"""NeMo's own cache-aware streaming loop: the reference every engine result is checked against.

This is NeMo's simulation loop (examples/asr/asr_cache_aware_streaming/
speech_to_text_cache_aware_streaming_infer.py, `perform_streaming`): whole-file features in
`CacheAwareStreamingAudioBuffer`, default chunking (first chunk 1+8R frames with drop 0, then
9 history + 8(R+1) frames with drop 2), `conformer_stream_step` carrying caches and
hypotheses, one utterance at a time, at the model's own dtype. Nothing of the engine is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from nemo.collections.asr.parts.utils.streaming_utils import CacheAwareStreamingAudioBuffer


@dataclass
class OracleResult:
    token_ids: list[int]
    text: str


@torch.inference_mode()
def oracle_transcribe(model, audio: np.ndarray, language: str | None = None) -> OracleResult:
    """Transcribe one utterance (float32 at the model's rate) with NeMo's loop on `model` (a ServedModel)."""
    nemo = model.nemo
    if model.prompt_dictionary is not None:
        nemo.set_inference_prompt(language or model.default_language)
    buffer = CacheAwareStreamingAudioBuffer(model=nemo, online_normalization=False, pad_and_drop_preencoded=False)
    buffer.append_audio(np.asarray(audio, dtype=np.float32))
    cache_ch, cache_t, cache_len = nemo.encoder.get_initial_cache_state(batch_size=1, dtype=model.dtype)
    hyps = None
    pred_out = None
    for step, (chunk, lengths) in enumerate(iter(buffer)):
        pred_out, _, cache_ch, cache_t, cache_len, hyps = nemo.conformer_stream_step(
            processed_signal=chunk.to(model.dtype),
            processed_signal_length=lengths,
            cache_last_channel=cache_ch,
            cache_last_time=cache_t,
            cache_last_channel_len=cache_len,
            keep_all_outputs=buffer.is_buffer_empty(),
            previous_hypotheses=hyps,
            previous_pred_out=pred_out,
            drop_extra_pre_encoded=0 if step == 0 else nemo.encoder.streaming_cfg.drop_extra_pre_encoded,
            return_transcription=True,
        )
    if hyps is None:
        return OracleResult([], "")
    ids = [int(t) for t in hyps[0].y_sequence.tolist()]
    return OracleResult(ids, _text(nemo, ids))


def _text(nemo, ids: list[int]) -> str:
    tok = getattr(nemo, "tokenizer", None)
    if tok is not None:
        return tok.ids_to_text(ids) if ids else ""
    vocab = list(nemo.joint.vocabulary)
    return "".join(vocab[i] for i in ids)
