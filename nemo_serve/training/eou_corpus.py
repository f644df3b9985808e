"""A small corpus for the EOU fine-tune (train --eou): the demo corpus's held-out splits and a short
espeak-ng training split, drawn exactly as `corpus.main` draws them (same seed, same sentences for the
same --n-eval), without the flite set and the extra synthesizers: the fine-tune had ~40 minutes of
two shared CPU cores, most of which synthesis would otherwise take.

    python -m nemo_serve.training.eou_corpus --out work_data/eou_corpus --n-train 1000 --n-eval 100
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from .corpus import build_split
from .sentences import held_out_sets, training_sentences
from .synthesizers import ESPEAK_VOICES, HELDOUT_VARIANTS, TRAIN_VARIANTS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-eval", type=int, default=100)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    dev, hs, hv, fl = held_out_sets(rng, a.n_eval)  # as corpus.main: the flite set is drawn, not made
    train = training_sentences(rng, a.n_train, set(dev) | set(hs) | set(hv) | set(fl))
    build_split("dev", dev, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 1, a.workers, keep=True)
    build_split("heldout_sentences", hs, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 2, a.workers, keep=True)
    build_split("heldout_voices", hv, "espeak", ESPEAK_VOICES, HELDOUT_VARIANTS, out, a.seed + 3, a.workers, keep=True)
    build_split("train", train, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 5, a.workers, keep=True)


if __name__ == "__main__":
    main()
