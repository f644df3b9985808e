"""NeMo's own cache-aware streaming loop: the reference every engine result is checked against.

This is NeMo's simulation loop (examples/asr/asr_cache_aware_streaming/
speech_to_text_cache_aware_streaming_infer.py, `perform_streaming`): whole-file features in
`CacheAwareStreamingAudioBuffer`, default chunking (first chunk 1+8R frames with drop 0, then
9 history + 8(R+1) frames with drop 2), `conformer_stream_step` carrying caches and
hypotheses, one utterance at a time, at the model's own dtype. Nothing of the engine is used.

The one copy of that loop: the self-test and the parity tests call `oracle_transcribe`, the
streaming WER (training/evaluate.py) `nemo_loop`, and the step benchmark times `loop_step`
over chunks it prepares up front with `loop_chunks`.

Phrase boosting's oracle (`phrases`): NeMo's own decoding with a boosting tree, configured as a
NeMo user configures it: `change_decoding_strategy` with `greedy.boosting_tree` (the phrase list)
and `greedy.boosting_tree_alpha` (the boost), for the call; the model's decoding is put back after.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from nemo.collections.asr.parts.utils.streaming_utils import CacheAwareStreamingAudioBuffer


@dataclass
class OracleResult:
    token_ids: list[int]
    text: str


@dataclass
class LoopState:
    """What NeMo's loop carries from one conformer_stream_step to the next, for one utterance."""

    cache_channel: torch.Tensor
    cache_time: torch.Tensor
    cache_len: torch.Tensor
    hyps: list | None = None
    pred_out: list | None = None
    steps: int = 0

    @classmethod
    def initial(cls, nemo, dtype: torch.dtype = torch.float32) -> "LoopState":
        return cls(*nemo.encoder.get_initial_cache_state(batch_size=1, dtype=dtype))

    @property
    def token_ids(self) -> list[int]:
        return [int(t) for t in self.hyps[0].y_sequence.tolist()] if self.hyps else []

    @property
    def text(self) -> str:
        """NeMo's own text of the hypothesis (its decoding's detokenisation)."""
        return self.hyps[0].text if self.hyps else ""


def _buffer(nemo, audio: np.ndarray, pad_and_drop: bool) -> CacheAwareStreamingAudioBuffer:
    buffer = CacheAwareStreamingAudioBuffer(model=nemo, online_normalization=False, pad_and_drop_preencoded=pad_and_drop)
    buffer.append_audio(np.asarray(audio, dtype=np.float32))
    return buffer


@torch.inference_mode()
def loop_chunks(nemo, audio: np.ndarray, dtype: torch.dtype = torch.float32, pad_and_drop: bool = False) -> list:
    """The buffer's chunks of one utterance (float32 at the model's rate): [(chunk, lengths, is_last)].

    pad_and_drop: NeMo's other grid (9 zero frames before the first chunk, drop 2 on every call).
    """
    buffer = _buffer(nemo, audio, pad_and_drop)
    return [(chunk.to(dtype), lengths, buffer.is_buffer_empty()) for chunk, lengths in iter(buffer)]


def whole_file_features(nemo, audio: np.ndarray) -> torch.Tensor:
    """[1, F, T] features of one utterance, as the buffer computes them before chunking."""
    buffer = _buffer(nemo, audio, pad_and_drop=False)
    return buffer.buffer[:, :, : int(buffer.streams_length[0])]


@torch.inference_mode()
def loop_step(nemo, state: LoopState, chunk, lengths, is_last: bool, pad_and_drop: bool = False) -> None:
    """One conformer_stream_step of one utterance, called exactly as NeMo's example script calls it."""
    drop = nemo.encoder.streaming_cfg.drop_extra_pre_encoded
    state.pred_out, _, state.cache_channel, state.cache_time, state.cache_len, state.hyps = nemo.conformer_stream_step(
        processed_signal=chunk,
        processed_signal_length=lengths,
        cache_last_channel=state.cache_channel,
        cache_last_time=state.cache_time,
        cache_last_channel_len=state.cache_len,
        keep_all_outputs=is_last,
        previous_hypotheses=state.hyps,
        previous_pred_out=state.pred_out,
        drop_extra_pre_encoded=drop if (state.steps > 0 or pad_and_drop) else 0,
        return_transcription=True,
    )
    state.steps += 1


@torch.inference_mode()
def nemo_loop(nemo, audio: np.ndarray, dtype: torch.dtype = torch.float32, pad_and_drop: bool = False) -> LoopState:
    """One utterance through the whole loop on a NeMo model; the language prompt is the caller's to set."""
    state = LoopState.initial(nemo, dtype)
    for chunk, lengths, is_last in loop_chunks(nemo, audio, dtype, pad_and_drop):
        loop_step(nemo, state, chunk, lengths, is_last, pad_and_drop)
    return state


@contextlib.contextmanager
def nemo_boosting(nemo, phrases: list[str] | tuple[str, ...], boost: float):
    """NeMo's greedy decoding with a boosting tree of `phrases` at weight `boost`, for the block."""
    from omegaconf import open_dict

    from .engine.biasing import boosting_tree_config

    from nemo.collections.asr.models import EncDecHybridRNNTCTCModel

    saved_decoding, saved_cfg = nemo.decoding, copy.deepcopy(nemo.cfg.decoding)
    cfg = copy.deepcopy(nemo.cfg.decoding)
    with open_dict(cfg):
        cfg.greedy.boosting_tree = dataclasses.asdict(boosting_tree_config(tuple(phrases)))
        cfg.greedy.boosting_tree_alpha = float(boost)
    kw = {"decoder_type": "rnnt"} if isinstance(nemo, EncDecHybridRNNTCTCModel) else {}
    nemo.change_decoding_strategy(decoding_cfg=cfg, verbose=False, **kw)
    try:
        yield
    finally:
        nemo.decoding = saved_decoding
        with open_dict(nemo.cfg):
            nemo.cfg.decoding = saved_cfg


def oracle_transcribe(
    model, audio: np.ndarray, language: str | None = None, context_right: int | None = None,
    phrases: list[str] | tuple[str, ...] = (), boost: float = 1.0,
) -> OracleResult:  # fmt: skip
    """Transcribe one utterance (float32 at the model's rate) with NeMo's loop on `model` (a ServedModel)
    at one of its served modes (None: the default), NeMo's encoder switched to it for the call;
    with `phrases`, NeMo's decoder boosts them (module docstring)."""
    nemo = model.nemo
    boosting = nemo_boosting(nemo, phrases, boost) if phrases else contextlib.nullcontext()
    with model.nemo_mode(context_right), boosting:
        if model.prompt_dictionary is not None:
            nemo.set_inference_prompt(language or model.default_language)
        state = nemo_loop(nemo, audio, model.dtype)
    return OracleResult(state.token_ids, state.text)
