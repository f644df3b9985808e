"""SentencePiece tokenizers for the built-ins, trained in code and cached.

Trained with NeMo's own create_spt_model (which also writes the vocab.txt NeMo needs) on
Zipf-distributed pseudo-words generated in code, and cached in
~/.cache/nemo_serve/tokenizers/<name>-<hash of the recipe>/ ($NEMO_SERVE_CACHE moves it);
the 13,087-piece one trains in about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .common import quiet_nemo

CACHE_DIR = Path(os.environ.get("NEMO_SERVE_CACHE", Path.home() / ".cache" / "nemo_serve"))

# Part of the tokenizer cache key: bump when _pseudo_word_corpus or the trainer options change.
_TOKENIZER_RECIPE_VERSION = 1


def ensure_tokenizer(name: str, recipe: DictConfig) -> Path:
    """Directory holding tokenizer.model, tokenizer.vocab and vocab.txt for a recipe; trained once, then cached.

    Trained with NeMo's own create_spt_model (which also writes the vocab.txt NeMo requires)
    on a pseudo-word corpus generated in code. Written to a temp dir and renamed, so that
    concurrent builders never see half a tokenizer.
    """
    recipe_dict = OmegaConf.to_container(recipe, resolve=True)
    key = json.dumps({"v": _TOKENIZER_RECIPE_VERSION, **recipe_dict}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    final_dir = CACHE_DIR / "tokenizers" / f"{name}-{digest}"
    if (final_dir / "vocab.txt").exists():
        return final_dir
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import create_spt_model

    final_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final_dir.parent))
    try:
        corpus_path = work_dir / "corpus.txt"
        corpus_path.write_text(
            _pseudo_word_corpus(
                recipe.lexicon_size, recipe.corpus_words, recipe.get("extra_letters", ""), recipe.get("seed", 0)
            ),
            encoding="utf-8",
        )
        out_dir = work_dir / "tokenizer"
        with quiet_nemo(), _quiet_fds():
            create_spt_model(
                str(corpus_path),
                vocab_size=recipe.vocab_size,
                sample_size=-1,
                do_lower_case=False,
                tokenizer_type=recipe.type,
                output_dir=str(out_dir),
                character_coverage=1.0,
                # e.g. tiny-eou's <EOU>/<EOB>: whole pieces, never split or merged
                user_defined_symbols=list(recipe.user_defined_symbols) if recipe.get("user_defined_symbols") else None,
            )
        num_pieces = sum(1 for _ in open(out_dir / "tokenizer.vocab", encoding="utf-8"))
        if num_pieces != recipe.vocab_size:
            # create_spt_model passes hard_vocab_limit=false: a corpus too small silently gives fewer pieces.
            raise RuntimeError(f"{name}: tokenizer has {num_pieces} pieces, recipe asks {recipe.vocab_size}")
        (out_dir / "recipe.json").write_text(key)
        try:
            os.rename(out_dir, final_dir)
        except OSError:
            if not (final_dir / "vocab.txt").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return final_dir


def _pseudo_word_corpus(lexicon_size: int, num_words: int, extra_letters: str, seed: int) -> str:
    """Deterministic text of Zipf-distributed pseudo-words built from syllables: enough merges for BPE."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z"]
    onsets += ["br", "cr", "dr", "fr", "gr", "pr", "tr", "st", "sp", "sk", "sl", "pl", "bl", "cl", "fl"]
    onsets += ["gl", "ch", "sh", "th", "qu", "ph", "wh", "sn", "sm", "tw", "str"]
    vowels = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "oo", "ou", "ie", "au", "oi"] + list(extra_letters)
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "nt", "st", "rk", "ng", "ck", "x", "ll", "ss"]
    codas += ["rt", "ld", "mp", "'s"]
    lexicon: set[str] = set()
    while len(lexicon) < lexicon_size:
        num_syllables = rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
        lexicon.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(num_syllables)))
    words = sorted(lexicon)
    rng.shuffle(words)
    weights = [1.0 / (rank + 10) ** 0.9 for rank in range(len(words))]
    stream = rng.choices(words, weights=weights, k=num_words)
    lines, i = [], 0
    while i < len(stream):
        n = rng.randint(4, 14)
        lines.append(" ".join(stream[i : i + n]))
        i += n
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _quiet_fds():
    """Silence C++ stderr chatter (SentencePiece's trainer) for the block."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
