"""A stream's boosted phrases as the client sends them: limits, checks, the normalised request.

Pure host code (no torch, no NeMo), so the front ends check a config message before any audio;
engine/biasing.py turns a request into NeMo's boosting tree.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_BIASING = -1  # multi_biasing_ids value of a row without phrases (NeMo's dummy model)
DEFAULT_BOOST = 1.0


@dataclass(frozen=True)
class PhraseLimits:
    """Server-wide limits (config.py flags). `max_phrases_total` counts the phrases of all open
    streams; streams with the same list still count each."""

    max_phrases_per_stream: int = 100
    max_phrase_chars: int = 64
    max_phrases_total: int = 10000
    max_boost: float = 10.0


@dataclass(frozen=True)
class PhraseRequest:
    """One stream's phrases, checked and normalised (`check_phrases`): the tree's cache key."""

    phrases: tuple[str, ...]
    boost: float

    def __bool__(self) -> bool:
        return bool(self.phrases)


def encodable_characters(vocabulary: list[str]) -> frozenset[str]:
    """Characters some vocabulary entry holds (SentencePiece's word marker stands for a space):
    a character outside this set becomes <unk>, which a phrase may not contain. Special entries
    (`<unk>`, `<s>`) spell nothing."""
    pieces = [v for v in vocabulary if not (len(v) > 2 and v.startswith("<") and v.endswith(">"))]
    chars = set("".join(pieces).replace("\u2581", " "))
    chars.add(" ")
    return frozenset(chars)


def check_phrases(phrases, boost, limits: PhraseLimits, encodable: frozenset[str], tokenized: bool = True) -> PhraseRequest:
    """A client's `phrases` and `boost` as a PhraseRequest, or ValueError naming what is wrong.
    Whitespace is collapsed and duplicates dropped (order kept), so equal lists share a tree.
    `tokenized`: the model has a tokenizer (BPE); NeMo builds boosting trees only through one."""
    if phrases is None:
        phrases = []
    if phrases and not tokenized:
        raise ValueError("phrase boosting needs a model with a tokenizer (BPE); this one has characters only")
    if not isinstance(phrases, list) or not all(isinstance(p, str) for p in phrases):
        raise ValueError("phrases must be a list of strings")
    if boost is None:
        boost = DEFAULT_BOOST
    if isinstance(boost, bool) or not isinstance(boost, (int, float)) or not 0 < boost <= limits.max_boost:
        raise ValueError(f"boost must be a number in (0, {limits.max_boost:g}]")
    if len(phrases) > limits.max_phrases_per_stream:
        raise ValueError(f"{len(phrases)} phrases; at most {limits.max_phrases_per_stream} per stream")
    clean: dict[str, None] = {}
    for i, raw in enumerate(phrases):
        phrase = " ".join(raw.split())
        if not phrase:
            raise ValueError(f"phrase {i} is empty")
        if len(phrase) > limits.max_phrase_chars:
            raise ValueError(f"phrase {i} has {len(phrase)} characters; at most {limits.max_phrase_chars}")
        unknown = sorted({c for c in phrase if c not in encodable})
        if unknown:
            raise ValueError(f"phrase {i} ({phrase!r}) has characters the model cannot spell: {''.join(unknown)!r}")
        clean[phrase] = None
    return PhraseRequest(tuple(clean), float(boost))
