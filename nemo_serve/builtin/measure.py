"""Emission of the built-ins under NeMo's own offline decoding: `python -m nemo_serve.builtin [NAME ...]`.

Measured (CPU, 2 shared cores, torch 2.13, NeMo 3.0.0, seed 0; emission on 3 x 8 s of
synthetic audio the calibration never saw, NeMo's own offline chunked-limited decoding):

  name             parameters   build s  construct/encode/joint s  emitting frames  tokens/frame  distinct
  tiny-char           272,861       4        0.6 /  1.5 /  1.9         0.25-0.28       0.32-0.37     23-27 /  28
  tiny-hybrid         281,730       4        1.0 /  1.4 /  1.7         0.28-0.30       0.36-0.38     39-42 /  64
  tiny-prompt         315,649       5        0.9 /  1.6 /  2.0         0.29-0.38       0.39-0.51     58-75 / 128
  fastconformer-l 114,752,514      45        7   / 15   / 23           0.29-0.36       0.35-0.43    93-117 / 1024
  nemotron-0.6b   638,439,456      82       23   / 21   / 38           0.22-0.39       0.29-0.54    87-156 / 13087
Ranges are over the trained modes and, for prompt models, en-US, de-DE and fr-FR or es-ES;
"distinct" counts different tokens among the 90-160 emitted per mode, over the vocabulary.
The first build in a process also pays 10-25 s of NeMo import, and the machine's load
average was 4-6 on its 2 cores: an idle machine is faster. 70-85% of emitting frames carry
one token, the rest two or three; frames with 4+ are under 1%. Near-silence emits nothing
after the first second except, sometimes, on the last frame. Nemotron's construct time is
NeMo's own: each copy of a 13k-entry label list through OmegaConf costs about a second and
the constructor makes dozens; restore_from of the real model pays it too.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional, Sequence

import torch

from ..synth import synth_audio
from . import BUILTIN_NAMES, build_builtin


@torch.no_grad()
def decode_offline(model, audio: torch.Tensor, att_context_size: Sequence[int], lang: Optional[str] = None):
    """NeMo's own offline chunked-limited forward + greedy decoding of a batch [B, T] of equal-length audio.

    Returns (hypotheses, encoded_len). For a prompt model, `lang` is a prompt_dictionary key.
    """
    model.encoder.set_default_att_context_size(list(att_context_size))
    lengths = torch.full((audio.shape[0],), audio.shape[1])
    kwargs = {}
    if getattr(model, "concat", False):
        prompts = model.cfg.model_defaults.prompt_dictionary
        index = prompts[lang or next(iter(prompts))]
        kwargs["prompt_indices"] = torch.full((audio.shape[0],), index, dtype=torch.long)
    encoded, encoded_len = model.forward(input_signal=audio, input_signal_length=lengths, **kwargs)
    hyps = model.decoding.rnnt_decoder_predictions_tensor(
        encoder_output=encoded, encoded_lengths=encoded_len, return_hypotheses=True
    )
    return hyps, encoded_len


def emission_stats(hyps, encoded_len) -> dict:
    """Tokens per frame, fraction of frames emitting, distinct tokens, frames cut at max_symbols."""
    frames = int(encoded_len.sum())
    tokens, emitting, distinct = 0, 0, set()
    for hyp in hyps:
        ids = [int(i) for i in hyp.y_sequence]
        stamps = hyp.timestamp["timestep"] if isinstance(hyp.timestamp, dict) else hyp.timestamp
        stamps = [int(s) for s in stamps]
        tokens += len(ids)
        emitting += len(set(stamps))
        distinct.update(ids)
    return {
        "frames": frames,
        "tokens_per_frame": tokens / frames,
        "emitting_fraction": emitting / frames,
        "distinct_tokens": len(distinct),
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`python -m nemo_serve.builtin [NAME ...] [--seed N]`: build, then print what the module
    docstring reports (parameters, build time, emission per mode and language) as JSON lines."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("names", nargs="*", default=list(BUILTIN_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--utterances", type=int, default=3, help="8 s synthetic test utterances per mode")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    audio = torch.stack([synth_audio(8.0, 1000 + i) for i in range(args.utterances)])
    for name in args.names:
        start = time.perf_counter()
        model = build_builtin(name, args.seed)
        row = {
            "name": name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "build_s": round(time.perf_counter() - start, 1),
            "modes": {},
        }
        langs = list(model.cfg.model_defaults.prompt_dictionary)[:3] if getattr(model, "concat", False) else [None]
        for mode in model.encoder.att_context_size_all:
            for lang in langs:
                stats = emission_stats(*decode_offline(model, audio, mode, lang))
                key = f"{list(mode)}" + (f" {lang}" if lang else "")
                row["modes"][key] = {k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()}
        print(json.dumps(row), flush=True)
