"""Diarization error rate, md-eval style, on a 10 ms grid.

DER = (missed speech + false alarm + speaker confusion) / reference speech, overlap scored (every
speaker of an overlapped frame counts), hypothesis speakers mapped one-to-one onto reference speakers
to maximise the time they agree (Hungarian), frames within `collar_s` of any reference boundary not
scored (md-eval's `-c 0.25` is a collar of 0.25 s on each side of each boundary, the common setting).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GRID_S = 0.01


@dataclass
class DerCounts:
    scored_speech_s: float = 0.0
    missed_s: float = 0.0
    false_alarm_s: float = 0.0
    confusion_s: float = 0.0

    def __iadd__(self, other: "DerCounts") -> "DerCounts":
        self.scored_speech_s += other.scored_speech_s
        self.missed_s += other.missed_s
        self.false_alarm_s += other.false_alarm_s
        self.confusion_s += other.confusion_s
        return self

    @property
    def der(self) -> float:
        return (self.missed_s + self.false_alarm_s + self.confusion_s) / max(self.scored_speech_s, 1e-9)

    def as_dict(self) -> dict:
        return {"der": round(self.der, 5), "missed_s": round(self.missed_s, 2),
                "false_alarm_s": round(self.false_alarm_s, 2),
                "confusion_s": round(self.confusion_s, 2), "scored_speech_s": round(self.scored_speech_s, 2)}


def segments_to_grid(segments, num_cells: int) -> np.ndarray:
    """bool [num_cells, num_speakers] from (speaker, start_s, end_s) segments (speakers numbered from 0)."""
    num_speakers = max((k for k, _, _ in segments), default=-1) + 1
    grid = np.zeros((num_cells, max(num_speakers, 1)), bool)
    for k, start_s, end_s in segments:
        grid[int(round(start_s / GRID_S)): int(round(end_s / GRID_S)), k] = True
    return grid


def preds_to_segments(preds: np.ndarray, frame_s: float = 0.08, threshold: float = 0.5):
    """(speaker, start_s, end_s) runs where a speaker's probability is above threshold ([T, K] preds)."""
    segments = []
    for k in range(preds.shape[1]):
        edges = np.diff(np.concatenate([[0], (preds[:, k] > threshold).astype(np.int8), [0]]))
        for s, e in zip(np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]):
            segments.append((k, round(s * frame_s, 2), round(e * frame_s, 2)))
    return segments


def der_counts(reference, hypothesis, duration_s: float, collar_s: float = 0.25) -> DerCounts:
    """Error times of one recording: reference and hypothesis as (speaker, start_s, end_s) segments."""
    from scipy.optimize import linear_sum_assignment

    cells = int(round(duration_s / GRID_S)) + 1
    ref, hyp = segments_to_grid(reference, cells), segments_to_grid(hypothesis, cells)
    scored = _outside_collars(reference, cells, collar_s)
    ref, hyp = ref[scored], hyp[scored]
    agree = ref.T.astype(np.int64) @ hyp.astype(np.int64)  # [R, H] cells both speak
    rows, cols = linear_sum_assignment(-agree)
    n_ref, n_hyp = ref.sum(axis=1), hyp.sum(axis=1)
    correct = np.zeros(len(ref), np.int64)
    for r, h in zip(rows, cols):
        correct += ref[:, r] & hyp[:, h]
    return DerCounts(
        scored_speech_s=float(n_ref.sum()) * GRID_S,
        missed_s=float(np.maximum(n_ref - n_hyp, 0).sum()) * GRID_S,
        false_alarm_s=float(np.maximum(n_hyp - n_ref, 0).sum()) * GRID_S,
        confusion_s=float((np.minimum(n_ref, n_hyp) - correct).sum()) * GRID_S,
    )


def _outside_collars(reference, cells: int, collar_s: float) -> np.ndarray:
    scored = np.ones(cells, bool)
    width = int(round(collar_s / GRID_S))
    for _, start_s, end_s in reference:
        for edge in (int(round(start_s / GRID_S)), int(round(end_s / GRID_S))):
            scored[max(0, edge - width): edge + width] = False
    return scored
