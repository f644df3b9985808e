"""Edit distance: token errors against NeMo's loop (benchmarks) and word errors (training, evaluation)."""

from __future__ import annotations

from collections.abc import Sequence


def edit_distance(ref: Sequence, hyp: Sequence) -> int:
    """Levenshtein distance (substitutions, insertions, deletions all cost 1), one row of memory."""
    d = list(range(len(hyp) + 1))
    for i in range(1, len(ref) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(hyp) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (ref[i - 1] != hyp[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(hyp)]


def word_errors(ref: str, hyp: str) -> tuple[int, int]:
    """(word edits, reference words) of whitespace-split texts: WER is the sum of one over the sum of the other."""
    words = ref.split()
    return edit_distance(words, hyp.split()), len(words)
