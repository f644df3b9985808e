"""Streaming WER of a cache-aware model with NeMo's own cache-aware loop.

For every held-out set and every lookahead mode (att_context_size [56, R], R in 0/3/6/13) each utterance is
streamed alone through ``CacheAwareStreamingAudioBuffer`` + ``model.conformer_stream_step`` exactly like
NeMo's ``speech_to_text_cache_aware_streaming_infer.py`` (default mode: first chunk with
``drop_extra_pre_encoded=0``, then the encoder's ``drop_extra_pre_encoded``; greedy_batch RNN-T decoding,
max_symbols 10, loop_labels), and WER is the word-level edit distance summed over the set.

Usage::

    python -m nemo_serve.training.evaluate --model nemo_serve/assets/demo/demo.nemo --data work_data/corpus \
        [--sets heldout_sentences heldout_voices flite] [--rights 0 3 6 13] [--limit 200] [--json out.json]
        [--chain 4]   # stream groups of 4 consecutive utterances as one, 0.3 s of silence between them

Prints one line per (set, mode) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..audio_io import load_manifest
from ..oracle import nemo_loop
from ..scoring import word_errors
from .batches import chain_dev  # the same joining as the training dev WER

DEFAULT_SETS = ["heldout_sentences", "heldout_voices", "flite"]
DEFAULT_RIGHTS = [0, 3, 6, 13]
LEFT = 56


def load_model(path: str):
    from nemo.collections.asr.models import ASRModel

    model = ASRModel.restore_from(str(path), map_location=torch.device("cpu"))
    model.eval()
    return model


def set_mode(model, right: int, left: int = LEFT) -> None:
    model.encoder.set_default_att_context_size([left, right])
    model.encoder.setup_streaming_params()


def stream_transcribe(model, audio: np.ndarray) -> str:
    """One utterance (float32 mono 16 kHz) through NeMo's cache-aware streaming loop; returns the text."""
    return nemo_loop(model, audio).text.strip()


def chain(utts: list, k: int, pause_s: float = 0.3) -> list:
    """Groups of k consecutive (row, audio) utterances as one stream: audio joined with pause_s of
    silence, reference texts joined. A live stream is many sentences long; the held-out sets are one."""
    if k <= 1:
        return utts
    wavs, texts = chain_dev([audio for _, audio in utts], [row["text"] for row, _ in utts], k, pause_s)
    return [({"text": t}, w) for w, t in zip(wavs, texts)]


def evaluate(model, data: Path, sets=DEFAULT_SETS, rights=DEFAULT_RIGHTS, limit=None, verbose=0, chain_k=1) -> dict:
    results = {}
    for s in sets:
        utts = chain(load_manifest(Path(data) / f"{s}.jsonl", limit=limit), chain_k)
        for r in rights:
            set_mode(model, r)
            t0 = time.time()
            errs = words = 0
            for i, (row, audio) in enumerate(utts):
                hyp = stream_transcribe(model, audio)
                e, n = word_errors(row["text"], hyp)
                errs, words = errs + e, words + n
                if verbose and i < verbose:
                    print(f"   [{s} R={r}] {row['text']!r} -> {hyp!r}", flush=True)
            wer = errs / max(words, 1)
            results[(s, r)] = {"wer": wer, "errors": errs, "words": words, "utts": len(utts),
                               "seconds": round(time.time() - t0, 1)}
            print(f"{s:18s} R={r:2d} ({(r + 1) * 80:4d} ms chunk): WER {100 * wer:6.2f}% "
                  f"({errs}/{words} words, {len(utts)} utts, {time.time() - t0:.0f}s)", flush=True)
    set_mode(model, max(rights))
    return results


def markdown_table(results: dict, sets=DEFAULT_SETS, rights=DEFAULT_RIGHTS) -> str:
    head = "| held-out set | " + " | ".join(f"R={r} ({(r + 1) * 80} ms chunk)" for r in rights) + " |"
    sep = "|---|" + "---|" * len(rights)
    lines = [head, sep]
    for s in sets:
        n = results[(s, rights[0])]["utts"]
        cells = [f"{100 * results[(s, r)]['wer']:.2f}%" for r in rights]
        lines.append(f"| {s} ({n} utts) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="directory with <set>.jsonl manifests")
    p.add_argument("--sets", nargs="+", default=DEFAULT_SETS)
    p.add_argument("--rights", nargs="+", type=int, default=DEFAULT_RIGHTS)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--verbose", type=int, default=0, help="print the first N hypotheses per set/mode")
    p.add_argument("--json", default=None)
    p.add_argument("--chain", type=int, default=1, help="stream groups of N consecutive utterances as one")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_model(a.model)
    res = evaluate(model, Path(a.data), a.sets, a.rights, a.limit, a.verbose, a.chain)
    print()
    print(markdown_table(res, a.sets, a.rights))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{s}@R{r}": v for (s, r), v in res.items()}, f, indent=1)


if __name__ == "__main__":
    main()
