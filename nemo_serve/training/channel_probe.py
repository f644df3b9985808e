"""How much of a held-out voice's error is its channel? Score it as recorded and equalised.

The held-out flite voice (rms) has a long-term spectrum unlike the training flite voices': more energy
below about 300 Hz and above 2 kHz (9 dB more above 4 kHz), 4-5 dB less around 0.6-0.9 kHz.  This tool
measures how much of its WER that alone explains: it adds, to every log-mel frame of the held-out voice,
the difference between the training flite voices' mean log-mel (their loud frames) and its own, and
scores both with greedy RNN-T over the whole utterance
(the default [56,13] mode, as the trainer's dev WER).  A large drop says the model hears the channel, not
the speaker, and random channels in training (``train --channel-eq-db``) are the remedy.

Usage::

    python -m nemo_serve.training.channel_probe --model nemo_serve/assets/demo/demo.nemo --data work_data/corpus
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..audio_io import load_manifest
from ..scoring import word_errors
from .synthesizers import FLITE_TRAIN_VOICES
from .evaluate import load_model
from .batches import collate
from .dev_wer import hyp_text


@torch.no_grad()
def log_mels(model, audios: list) -> tuple[torch.Tensor, torch.Tensor]:
    sig, sig_len, _, _ = collate(audios, [[0]] * len(audios))
    return model.preprocessor(input_signal=sig, length=sig_len)


@torch.no_grad()
def mean_log_mel(model, audios: list, loud: float = 0.3) -> torch.Tensor:
    """Mean log-mel over each utterance's frames above its `loud` quantile of frame energy, averaged over
    utterances: the voice's long-term spectrum with silence and pauses left out."""
    feats, lens = log_mels(model, audios)
    means = []
    for f, n in zip(feats, lens):
        x = f[:, : int(n)]
        e = x.mean(0)
        means.append(x[:, e > e.quantile(loud)].mean(1))
    return torch.stack(means).mean(0)


@torch.no_grad()
def wer(model, rows: list, offset: torch.Tensor | None = None, batch: int = 25) -> float:
    errors = words = 0
    for b in range(0, len(rows), batch):
        part = rows[b : b + batch]
        feats, lens = log_mels(model, [a for _, a in part])
        if offset is not None:
            feats = feats + offset[None, :, None]
        enc, enc_len = model.forward(processed_signal=feats, processed_signal_length=lens)
        hyps = model.decoding.rnnt_decoder_predictions_tensor(encoder_output=enc, encoded_lengths=enc_len)
        hyps = hyps[0] if isinstance(hyps, tuple) else hyps
        for (row, _), h in zip(part, hyps):
            e, n = word_errors(row["text"], hyp_text(h))
            errors, words = errors + e, words + n
    return errors / max(words, 1)


def probe(model, data: Path, limit: int = 100, per_voice: int = 60) -> dict:
    held = load_manifest(data / "flite.jsonl", dtype="int16", limit=limit)
    train = load_manifest(data / "train_flite.jsonl", dtype="int16", limit=40 * per_voice)
    refs = {v: mean_log_mel(model, [a for r, a in train if r["voice"] == v][:per_voice]) for v in FLITE_TRAIN_VOICES}
    held_mean = mean_log_mel(model, [a for _, a in held[:per_voice]])
    offset = torch.stack(list(refs.values())).mean(0) - held_mean
    out = {"utterances": len(held), "as_recorded": wer(model, held), "equalised": wer(model, held, offset)}
    for v in ("awb", "slt"):
        out[f"equalised_to_{v}"] = wer(model, held, refs[v] - held_mean)
    out["offset_db_every_8_bins"] = [round(float(x) * 10 / 2.302585, 1) for x in offset[::8]]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a corpus made with --n-train-flite (flite.jsonl, train_flite.jsonl)")
    p.add_argument("--limit", type=int, default=100, help="held-out utterances scored")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    print(json.dumps(probe(load_model(a.model), Path(a.data), a.limit)))


if __name__ == "__main__":
    main()
