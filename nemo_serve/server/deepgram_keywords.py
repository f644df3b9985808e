"""Deepgram's keyword options as nemo-serve's phrase boosting (engine/phrases.py), for /v1/listen.

  keywords=TERM[:INTENSIFIER]   (repeatable; Deepgram's Nova-2 option) -> a phrase TERM
  keyterm=PHRASE                (repeatable; Nova-3's)                  -> a phrase PHRASE

The engine boosts a stream's phrases with one weight. Intensifiers that agree are that weight
(none given: the engine's default, 1); ones that differ are refused, as Riva's mapping refuses
contexts of different boosts (rejected: the largest for all, which would boost terms the client
weighted lower; a client gets a clear 400 and can send one weight). An intensifier of 0 or below
is Deepgram's suppression, which boosting cannot do: refused. The phrases themselves (count,
length, characters the model can spell, the weight's range) are checked as /ws's `phrases` are
(engine/phrases.check_phrases), here before the body is read.
"""

from __future__ import annotations

import math

from ..engine.phrases import PhraseLimits, PhraseRequest, check_phrases, encodable_characters
from .logsafe import preview


def keyword_phrases(query, limits: PhraseLimits, vocabulary: list[str], tokenized: bool) -> PhraseRequest | None:
    """The request's `keywords` and `keyterm` as a checked PhraseRequest (None: neither given);
    ValueError naming the bad one. `tokenized`: the model has a tokenizer (phrases need one)."""
    phrases: list[str] = list(query.getlist("keyterm"))
    weights: set[float] = set()
    for raw in query.getlist("keywords"):
        term, _, intensifier = raw.rpartition(":") if ":" in raw else (raw, "", "1")  # Deepgram's default: 1
        try:
            weight = float(intensifier)
        except ValueError:
            raise ValueError(f"keywords {preview(raw, 40)}: the intensifier after ':' must be a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"keywords {preview(raw, 40)}: an intensifier of 0 or below (suppression) is not "
                             "supported; keywords are boosted only")  # fmt: skip
        weights.add(weight)
        phrases.append(term)
    if len(weights) > 1:
        raise ValueError(f"keywords: one intensifier for all keywords (this server boosts a stream's phrases with one "
                         f"weight; got {', '.join(f'{w:g}' for w in sorted(weights))})")  # fmt: skip
    if not phrases:
        return None
    boost = weights.pop() if weights else None  # keyterms alone: the engine's default
    try:
        return check_phrases(phrases, boost, limits, encodable_characters(vocabulary), tokenized)
    except ValueError as e:  # named as /ws names them: say which of Deepgram's options they are
        raise ValueError(f"keywords/keyterm (this server's phrases and boost): {e}") from None
