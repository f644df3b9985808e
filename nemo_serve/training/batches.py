"""The recipe's audio in RAM and its batches: manifests loaded as int16, padded batches, duration-
bucketed batches, and chained items (several utterances joined by pauses, for long-form training and dev)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..audio_io import load_manifest


def load_audio(manifest: Path, limit: int | None = None) -> tuple[list[np.ndarray], list[str]]:
    """int16 audio (held in RAM for the whole run: half of float32) and texts of a manifest's first `limit` rows."""
    rows = load_manifest(manifest, dtype="int16", limit=limit)
    return [audio for _, audio in rows], [row["text"] for row, _ in rows]


def collate(wavs: list[np.ndarray], token_lists: list[list[int]]):
    B = len(wavs)
    T = max(len(w) for w in wavs)
    U = max(max(len(t) for t in token_lists), 1)
    sig = torch.zeros(B, T)
    lab = torch.zeros(B, U, dtype=torch.long)
    for i, (w, t) in enumerate(zip(wavs, token_lists)):
        sig[i, : len(w)] = torch.from_numpy(w.astype(np.float32) / 32768.0)
        lab[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    sig_len = torch.tensor([len(w) for w in wavs], dtype=torch.long)
    lab_len = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    return sig, sig_len, lab, lab_len


def make_batches(durs: np.ndarray, idx: np.ndarray, batch_seconds: float, rng: np.random.Generator,
                 max_batch: int = 64) -> list[list[int]]:
    """Duration-bucketed batches: shuffle, sort within pools of 2000, cut by total padded seconds."""
    idx = idx.copy()
    rng.shuffle(idx)
    batches = []
    for p in range(0, len(idx), 2000):
        pool = sorted(idx[p: p + 2000], key=lambda i: durs[i])
        cur, cur_max = [], 0.0
        for i in pool:
            m = max(cur_max, durs[i])
            if cur and (m * (len(cur) + 1) > batch_seconds or len(cur) >= max_batch):
                batches.append(cur)
                cur, m = [], durs[i]
            cur.append(int(i))
            cur_max = m
        if cur:
            batches.append(cur)
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def make_chains(idx: np.ndarray, rng: np.random.Generator, prob: float, max_len: int) -> list[tuple[int, ...]]:
    """Training items for one epoch: each utterance once, in random order; with probability ``prob`` an item
    is 2..max_len consecutive (shuffled) utterances streamed as one.  A live stream runs many sentences
    through one encoder cache and one prediction-network state; a model that only ever saw single sentences
    drops the first words of every later one (docs/demo_model.md, "Long streams").  With ``prob`` 0 the
    items are the utterances in pool order and no random number is drawn, so older recipes batch as before."""
    if prob <= 0 or max_len < 2:
        return [(int(i),) for i in idx]
    idx = idx.copy()
    rng.shuffle(idx)
    items, i = [], 0
    while i < len(idx):
        k = int(rng.integers(2, max_len + 1)) if rng.random() < prob else 1
        items.append(tuple(int(j) for j in idx[i: i + k]))
        i += k
    return items


def join_chain(wavs: list[np.ndarray], item: tuple[int, ...], rng: np.random.Generator,
               pause_s: tuple[float, float] = (0.0, 0.6)) -> np.ndarray:
    """The utterances of one item with a random pause (near-silent noise) between each pair."""
    if len(item) == 1:
        return wavs[item[0]]
    parts = []
    for n, i in enumerate(item):
        if n:
            gap = int(rng.uniform(*pause_s) * 16000)
            parts.append((rng.standard_normal(gap) * 3).astype(np.int16))
        parts.append(wavs[i])
    return np.concatenate(parts)


def chain_dev(wavs: list[np.ndarray], texts: list[str], k: int, pause_s: float = 0.3):
    """Utterances joined k at a time with pause_s of silence, texts joined (dev here, ``evaluate --chain``)."""
    if k <= 1:
        return [], []
    pause = np.zeros(int(pause_s * 16000), dtype=wavs[0].dtype if wavs else np.int16)
    out_w, out_t = [], []
    for i in range(0, len(wavs), k):
        out_w.append(np.concatenate([x for w in wavs[i: i + k] for x in (w, pause)][:-1]))
        out_t.append(" ".join(texts[i: i + k]))
    return out_w, out_t
