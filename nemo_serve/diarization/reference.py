"""The oracle: NeMo's own streaming Sortformer loop, one stream at a time.

`nemo_chunks` cuts a stream's features the way NeMo's `forward_streaming` does (its
`streaming_feat_loader`, batch of one), and `nemo_reference_preds` feeds them to NeMo's
`forward_streaming_step` with a fresh async state: what any batched runtime must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FeatureChunk:
    """One step's input for one stream, as NeMo's loader yields it."""

    features: torch.Tensor  # [T_feat, F] left context + chunk + right context, 10 ms frames
    left_offset: int  # feature frames of left context at the start of `features`
    right_offset: int  # feature frames of right context at the end


def nemo_chunks(model, features: torch.Tensor) -> list[FeatureChunk]:
    """Cut one stream's features [F, T] into NeMo's streaming chunks."""
    lengths = torch.tensor([features.shape[1]])
    loader = model.sortformer_modules.streaming_feat_loader(features.unsqueeze(0), lengths, torch.zeros_like(lengths))
    return [FeatureChunk(chunk[0], left, right) for _, chunk, _, left, right in loader]


@torch.no_grad()
def nemo_reference_preds(model, chunks: list[FeatureChunk]) -> torch.Tensor:
    """Speaker probabilities [T, K] from NeMo's forward_streaming_step, one stream, chunk by chunk."""
    modules = model.sortformer_modules
    state = modules.init_streaming_state(batch_size=1, async_streaming=model.async_streaming, device=model.device)
    total_preds = torch.zeros((1, 0, modules.n_spk), device=model.device)
    for chunk in chunks:
        state, total_preds = model.forward_streaming_step(
            processed_signal=chunk.features.unsqueeze(0),
            processed_signal_length=torch.tensor([chunk.features.shape[0]]),
            streaming_state=state,
            total_preds=total_preds,
            left_offset=chunk.left_offset,
            right_offset=chunk.right_offset,
        )
    return total_preds[0]


@torch.no_grad()
def stream_features(model, audio: torch.Tensor) -> torch.Tensor:
    """Log-mel features [F, T] of one stream's whole audio, as NeMo's streaming mode makes them (no gain normalisation)."""
    features, lengths = model.process_signal(audio.unsqueeze(0), torch.tensor([audio.numel()]))
    return features[0, :, : int(lengths[0])]
