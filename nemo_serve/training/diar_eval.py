"""Diarization error rate of a streaming Sortformer on synthetic conversations (diar_corpus's held-out split).

Streaming through the project's batched path (nemo_serve.diarization: slots, `diarize_step`), every
conversation a row of one batch, at each latency setting of nemo_serve/diarization/settings.py; and the
offline forward over each whole conversation (full attention, no speaker cache) as a cross-check.
`--check-nemo N` also runs NeMo's own `forward_streaming_step` loop on the first N conversations and
reports the largest probability difference from the batched path. DER as diar_metrics says (collar
0.25 s each side of each reference boundary, overlap scored), speakers active where p > 0.5.

    python -m nemo_serve.training.diar_eval --model work_data/diar_run/best.nemo --data work_data/diar_corpus
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .diar_metrics import DerCounts, der_counts, preds_to_segments


@torch.no_grad()
def offline_preds(model, audio: torch.Tensor) -> torch.Tensor:
    """Speaker probabilities [T, K] of one whole recording in one forward (no speaker cache)."""
    lengths = torch.tensor([audio.numel()])
    features, lengths = model.process_signal(audio_signal=audio.unsqueeze(0), audio_signal_length=lengths)
    features = features[:, :, : int(lengths[0])]
    embs, emb_lengths = model.frontend_encoder(processed_signal=features, processed_signal_length=lengths)
    return model.forward_infer(embs, emb_lengths)[0]


@torch.no_grad()
def batched_streaming_preds(model, audios: list[torch.Tensor]) -> list[torch.Tensor]:
    """Speaker probabilities [T, K] per recording, all recordings streamed as rows of one batched step."""
    from ..diarization.reference import nemo_chunks, stream_features
    from ..diarization.slots import SpeakerCacheSlots
    from ..diarization.step import diarize_step, make_batch

    chunks = [nemo_chunks(model, stream_features(model, audio)) for audio in audios]
    pool = SpeakerCacheSlots.for_model(model, len(audios))
    slots = [pool.acquire(f"conv{i}") for i in range(len(audios))]
    outputs: list[list[torch.Tensor]] = [[] for _ in audios]
    for step in range(max(len(c) for c in chunks)):
        rows = [i for i in range(len(audios)) if step < len(chunks[i])]  # shorter recordings end early
        result = diarize_step(model, pool, make_batch([slots[i] for i in rows], [chunks[i][step] for i in rows]))
        for row, i in enumerate(rows):
            outputs[i].append(result.chunk_preds[row, : int(result.chunk_lengths[row])])
    for i in range(len(audios)):
        pool.release(f"conv{i}")
    return [torch.cat(out) for out in outputs]


def load_conversations(manifest: Path):
    """[(audio tensor, reference segments, duration_s)] of a diar_corpus split."""
    import soundfile as sf

    from .diar_corpus import read_rttm

    rows = []
    for line in open(manifest):
        row = json.loads(line)
        audio, _ = sf.read(manifest.parent / row["audio_filepath"], dtype="float32")
        rows.append((torch.from_numpy(audio), read_rttm(manifest.parent / row["rttm_filepath"]), row["duration"]))
    return rows


def score(preds: list[torch.Tensor], conversations, collar_s: float) -> DerCounts:
    counts = DerCounts()
    for p, (_, reference, duration) in zip(preds, conversations):
        counts += der_counts(reference, preds_to_segments(p.numpy()), duration, collar_s)
    return counts


def evaluate(model, conversations, settings: dict, check_nemo: int = 0) -> dict:
    """DER (collar 0.25 s and none) offline and per streaming setting; NeMo-loop differences if asked."""
    from ..diarization.reference import nemo_chunks, nemo_reference_preds, stream_features
    from ..diarization.settings import apply_settings

    audios = [audio for audio, _, _ in conversations]
    offline = [offline_preds(model, audio) for audio in audios]
    out = {"offline": {"collar_0.25": score(offline, conversations, 0.25).as_dict(),
                       "collar_0": score(offline, conversations, 0.0).as_dict()}, "streaming": {}}
    for name, setting in settings.items():
        apply_settings(model, setting)
        preds = batched_streaming_preds(model, audios)
        row = {"latency_ms": setting.latency_ms, "collar_0.25": score(preds, conversations, 0.25).as_dict(),
               "collar_0": score(preds, conversations, 0.0).as_dict()}
        if check_nemo:
            theirs = [nemo_reference_preds(model, nemo_chunks(model, stream_features(model, a)))
                      for a in audios[:check_nemo]]
            row["max_abs_diff_vs_nemo_loop"] = max(float((o - t).abs().max()) for o, t in zip(preds, theirs))
            row["decisions_equal_nemo_loop"] = all(torch.equal(o > 0.5, t > 0.5) for o, t in zip(preds, theirs))
        out["streaming"][name] = row
        print(name, json.dumps(row), flush=True)
    return out


def load_model(path: str):
    from nemo.collections.asr.models import SortformerEncLabelModel

    from ..builtin.common import quiet_nemo

    with quiet_nemo():
        model = SortformerEncLabelModel.restore_from(path, map_location="cpu")
    return model.float().eval()


def main(argv=None) -> None:
    from ..diarization.settings import MODEL_CARD_SETTINGS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--split", default="heldout")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--check-nemo", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    conversations = load_conversations(a.data / f"{a.split}.jsonl")[: a.limit or None]
    result = evaluate(load_model(a.model), conversations, MODEL_CARD_SETTINGS, a.check_nemo)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
