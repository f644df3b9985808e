"""The load generator's test set: items of audio, and NeMo's own loop tokens for each (cached on disk)."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import CACHE_DIR, SAMPLE_RATE, file_digest, model_file
from nemo_serve.audio_io import load_manifest


@dataclass
class LoadItem:
    item_id: str
    audio: np.ndarray  # float32 16 kHz
    text: str | None = None  # reference transcript, if the test set has one
    oracle: list[int] | None = None  # NeMo's loop tokens on the served model


def make_items(source: str, num_items: int = 16, seconds: tuple[float, float] = (10.0, 20.0)) -> list[LoadItem]:
    """synth: generated speech-like clips of 10-20 s (for random-weight models); a manifest:
    its utterances concatenated (0.3 s pauses) into items of about seconds[1], each item
    starting at a different utterance, with the joined texts as reference."""
    rng = random.Random(1234)
    if source == "synth":
        from nemo_serve.synth import synth_audio

        return [
            LoadItem(f"synth{i:02d}", synth_audio(rng.uniform(*seconds), seed=9000 + i).numpy())
            for i in range(num_items)
        ]
    utts = load_manifest(source, SAMPLE_RATE)
    pause = np.zeros(int(0.3 * SAMPLE_RATE), dtype=np.float32)
    items = []
    for i in range(min(num_items, len(utts))):
        k, parts, texts, n = i * len(utts) // num_items, [], [], 0
        while n < seconds[1] * SAMPLE_RATE and len(texts) < len(utts):
            row, audio = utts[k % len(utts)]
            parts += [audio, pause]
            texts.append(row.get("text", ""))
            n += len(audio) + len(pause)
            k += 1
        items.append(LoadItem(f"utt{i:02d}", np.concatenate(parts[:-1]), " ".join(texts)))
    return items


def oracle_cache_path(path: Path, items: list[LoadItem], context_right: int | None, dtype: str, device: str) -> Path:
    """Keyed on the weights' content, not the file's name or size: a retrained demo.nemo has the same size,
    and a stale oracle would count every served stream as a mismatch."""
    h = hashlib.sha256(f"{file_digest(path)}:{context_right}:{dtype}:{device}".encode())
    for it in items:
        h.update(it.audio.tobytes())
    return CACHE_DIR / f"oracle-{h.hexdigest()[:16]}.json"


def attach_oracle(
    items: list[LoadItem], model_spec: str, context_right: int | None, dtype: str = "fp32", device: str = "cpu"
) -> None:
    """NeMo's own loop on every item, cached on disk (minutes for FastConformer-L at 160 ms)."""
    import torch

    path, _ = model_file(model_spec)
    cache = oracle_cache_path(path, items, context_right, dtype, device)
    if cache.exists():
        tokens = json.loads(cache.read_text())
    else:
        from nemo_serve.model import load_model
        from nemo_serve.oracle import oracle_transcribe

        torch.set_num_threads(1)
        model = load_model(str(path), context_right=context_right, dtype=dtype, device=device)
        tokens = {}
        for it in items:
            tokens[it.item_id] = oracle_transcribe(model, it.audio).token_ids
            print(f"oracle {it.item_id}: {len(tokens[it.item_id])} tokens", file=sys.stderr, flush=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(tokens))
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    for it in items:
        it.oracle = tokens[it.item_id]
