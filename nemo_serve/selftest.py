"""`nemo-serve --selftest N`: the engine's tokens against NeMo's own cache-aware loop.

Each utterance is transcribed twice:
  oracle: NeMo's loop (nemo_serve.oracle), one utterance at a time, whole-file features;
  engine: the serving engine, streams starting at staggered times, audio pushed in random
          packet sizes (1 sample to 1.5 s), several streams sharing every batch.
The run passes only if every utterance's token ids are identical. With several modes served
(`--context-right 0,13` or `all`), utterances take the modes in turn and run in one engine at once,
each against NeMo's loop at its own mode.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .audio_io import audio_path, load_manifest, read_audio
from .engine.endpoint import EndpointConfig
from .core.inproc import LocalEngine
from .engine.loop import Engine
from .engine.greedy_joint import joint_mode
from .engine.nemo_decoder import decoder_name
from .engine.eou import EouTokens
from .model import ServedModel, load_model
from .oracle import oracle_transcribe
from .scoring import word_errors
from .synth import synth_audio

BUNDLED_MANIFEST = Path(__file__).parent / "assets" / "demo" / "utterances" / "manifest.jsonl"


@dataclass
class Utterance:
    name: str
    audio: np.ndarray  # float32 at the model's sample rate
    language: str | None = None
    text: str | None = None  # reference transcript, if known
    group: str | None = None  # the manifest's `set`, for a WER per set
    context_right: int | None = None  # the chunk mode it streams at (None: the default)


@dataclass
class Outcome:
    utt: Utterance
    oracle_ids: list[int]
    oracle_text: str
    engine_ids: list[int] = field(default_factory=list)
    engine_text: str = ""

    @property
    def identical(self) -> bool:
        return self.engine_ids == self.oracle_ids


# ----------------------------------------------------------------------------- inputs


def load_utterances(source: str | Path, sample_rate: int) -> list[Utterance]:
    """A directory of WAV files or a JSONL manifest (audio_filepath, text, language)."""
    source = Path(source)
    if source.is_dir():
        wavs = sorted(source.glob("*.wav"))
        if not wavs:
            raise FileNotFoundError(f"no .wav files in {source}")
        return [Utterance(p.name, read_audio(p, sample_rate)[0]) for p in wavs]
    return [
        Utterance(audio_path(source, row).name, audio, row.get("language") or row.get("lang"), row.get("text"),
                  row.get("set"))
        for row, audio in load_manifest(source, sample_rate)
    ]


def synthetic_utterances(n: int, sample_rate: int, seed: int) -> list[Utterance]:
    """Speech-like signals of 1-6 s (nemo_serve.synth): used only when no demo utterances are bundled."""
    rng = np.random.default_rng(seed)
    return [
        Utterance(f"synthetic-{i:03d}", synth_audio(rng.uniform(1.0, 6.0), seed * 1000 + i, sample_rate).numpy())
        for i in range(n)
    ]


def pick_utterances(model: ServedModel, n: int, audio: str | None, seed: int) -> list[Utterance]:
    sr = model.geometry.sample_rate
    if audio is not None:
        pool = load_utterances(audio, sr)
    elif BUNDLED_MANIFEST.exists():
        pool = load_utterances(BUNDLED_MANIFEST, sr)
    else:
        pool = synthetic_utterances(n, sr, seed)
    utts = [pool[i % len(pool)] for i in range(n)]
    if model.prompt_dictionary is not None and audio is None:
        # Bundled audio carries no language: give neighbours different ones so batches mix prompts.
        codes = sorted(model.prompt_dictionary)[:4]
        utts = [Utterance(u.name, u.audio, codes[i % len(codes)], u.text, u.group) for i, u in enumerate(utts)]
    modes = model.modes
    return [replace(u, context_right=modes[i % len(modes)]) for i, u in enumerate(utts)]


# ----------------------------------------------------------------------------- engine run


def paths_line(encoder_paths: dict, device) -> str:
    """`paths: layout=ring attention=matmul epilogues=fused/torch decoder=label_loop/all joint=full`:
    which path each part of the step took (engine/ring_cache.py, attention.py, epilogues.py,
    label_loop.py, greedy_joint.py), one word each, for a GPU run's records to parse."""
    parts = {**encoder_paths, "decoder": decoder_name(device), "joint": joint_mode()}
    return "paths: " + " ".join(f"{k}={v}" for k, v in parts.items())


def run_engine(
    model: ServedModel, utts: list[Utterance], num_slots: int, max_batch: int | None, seed: int, kv_cache: bool = True,
    out=sys.stdout,
):
    """Feed all utterances through one engine like many clients would; return token ids per utterance."""
    rng = random.Random(seed)
    results: list[list] = [[] for _ in utts]
    done = [threading.Event() for _ in utts]
    batch_sizes: list[int] = []
    engine = LocalEngine(
        Engine(
            model,
            num_slots=num_slots,
            max_batch=max_batch,
            endpoint=EndpointConfig(),  # endpointing on: segments must not change tokens
            kv_cache=kv_cache,
        ),
        on_step=lambda b, _s, _mode: batch_sizes.append(b),
    )
    print(engine.summary(), file=out, flush=True)
    print(f"kernels: {engine.engine.encoder.describe(engine.engine.pool)}", file=out, flush=True)
    print(paths_line(engine.engine.encoder.paths(engine.engine.pool), model.device), file=out, flush=True)
    engine.start()

    def on_result(i: int, r) -> None:
        results[i].append(r)
        if r.done:
            done[i].set()

    try:
        waiting = list(range(len(utts)))
        # Staggered starts: each utterance becomes due 0-60 ms after the previous one (and needs a free slot).
        due = np.cumsum([rng.uniform(0.0, 0.06) for _ in utts])
        active: dict[int, tuple] = {}  # utterance -> (stream, samples pushed)
        t_begin = time.monotonic()
        while waiting or active:
            now = time.monotonic() - t_begin
            while waiting and engine.num_free_slots > 0 and now >= due[waiting[0]]:
                i = waiting.pop(0)
                stream = engine.open_stream(lambda r, i=i: on_result(i, r), language=utts[i].language,
                                            context_right=utts[i].context_right)
                active[i] = (stream, 0)
            for i, (stream, pos) in list(active.items()):
                x = utts[i].audio
                n = rng.choice([1, 7, 160, 333, 1280, 4000, 8000, 24000])
                engine.push(stream, x[pos : pos + n])
                pos += n
                if pos >= len(x):
                    engine.finish(stream)
                    del active[i]
                else:
                    active[i] = (stream, pos)
            time.sleep(0.001)
            if engine.error is not None:
                raise RuntimeError("engine loop crashed") from engine.error
        deadline = time.monotonic() + 600
        for i, ev in enumerate(done):
            while not ev.wait(timeout=0.5):  # a crashed loop is reported as itself, not as a timeout
                if engine.error is not None:
                    raise RuntimeError("engine loop crashed") from engine.error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"utterance {utts[i].name} got no final result "
                                       f"({engine.num_open_streams} streams open)")
    finally:
        engine.stop()
    ids = [engine_token_ids(model, rs) for rs in results]
    texts = [" ".join(r.text for r in rs if r.is_final and r.text) for rs in results]
    return ids, texts, batch_sizes


def engine_token_ids(model: ServedModel, results: list) -> list[int]:
    """A stream's token ids as the decoder emitted them: every result's new tokens, and where a final
    was ended by an end-of-utterance token (engine/eou.py: cut out of what clients see), that token
    put back at the segment's end. So an EOU model is held to NeMo's loop too, EOU tokens and the
    place of every model-ended segment included."""
    reason_id = {reason: i for i, reason in EouTokens.from_vocabulary(model.vocabulary).id_to_reason.items()}
    ids: list[int] = []
    for r in results:
        ids.extend(r.new_token_ids)
        if r.is_final and r.end_reason in reason_id:
            ids.append(reason_id[r.end_reason])
    return ids


# ----------------------------------------------------------------------------- main


def wer_line(outcomes: list[Outcome]) -> str | None:
    """Word error rate of the engine's transcripts against the references, overall and per set.
    Informative only: the self-test passes or fails on token identity with NeMo's loop."""
    scored = [o for o in outcomes if o.utt.text is not None]
    if not scored:
        return None
    totals: dict[str, list[int]] = {}
    for o in scored:
        e, w = word_errors(o.utt.text, o.engine_text)
        for key in ("all", *([o.utt.group] if o.utt.group else [])):
            t = totals.setdefault(key, [0, 0])
            t[0], t[1] = t[0] + e, t[1] + w
    parts = [f"{key} {100 * e / max(w, 1):.1f}% ({e}/{w})" for key, (e, w) in totals.items()]
    return f"WER against the references ({len(scored)} utterances): " + ", ".join(parts)


def run_selftest(
    n: int = 20,
    model: str | None = None,
    context_right: int | list[int] | str | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
    audio: str | None = None,
    json_path: str | None = None,
    num_slots: int | None = None,
    max_batch: int | None = None,
    seed: int = 0,
    out=sys.stdout,
    kv_cache: bool = True,
) -> int:
    """Run the parity check; returns the process exit code (0 only if all N are token-identical)."""
    served = load_model(model, context_right=context_right, dtype=dtype, device=device)
    slots = num_slots or max(2, min(n, 8))
    utts = pick_utterances(served, n, audio, seed)
    outcomes = []
    for u in utts:
        o = oracle_transcribe(served, u.audio, u.language, u.context_right)
        outcomes.append(Outcome(u, o.token_ids, o.text))
    ids, texts, batch_sizes = run_engine(served, utts, slots, max_batch, seed, kv_cache, out)
    for o, i, t in zip(outcomes, ids, texts):
        o.engine_ids, o.engine_text = i, t
    k = 0
    for idx, o in enumerate(outcomes):
        k += o.identical
        mark = "ok  " if o.identical else "DIFF"
        lang = f" lang={o.utt.language}" if o.utt.language else ""
        if len(served.modes) > 1:
            lang += f" {served.geometry_for(o.utt.context_right).chunk_ms:.0f}ms"
        line = f"[{mark}] {idx:3d} {o.utt.name:<18} {len(o.utt.audio) / served.geometry.sample_rate:5.2f}s{lang} {len(o.oracle_ids):4d} tokens  {o.oracle_text[:60]!r}"
        if o.utt.text is not None:
            line += f"\n       reference {o.utt.text[:60]!r}"
        if not o.identical:
            first = next((j for j, (a, b) in enumerate(zip(o.engine_ids, o.oracle_ids)) if a != b), min(len(o.engine_ids), len(o.oracle_ids)))
            line += f"\n       engine {len(o.engine_ids)} tokens, first difference at token {first}: {o.engine_text[:60]!r}"
        print(line, file=out)
    if batch_sizes:
        multi = sum(b > 1 for b in batch_sizes)
        print(f"engine: {len(batch_sizes)} batched steps, max batch {max(batch_sizes)}, {multi} steps with >1 stream, {slots} slots", file=out)
    wer = wer_line(outcomes)
    if wer:
        print(wer, file=out)
    modes = [served.geometry_for(r) for r in served.modes]
    if len(modes) > 1:
        for g in modes:
            mine = [o for o in outcomes if o.utt.context_right == g.context_right]
            print(f"context-right {g.context_right:2d} ({g.chunk_ms:4.0f} ms): {sum(o.identical for o in mine)}/{len(mine)} token-identical", file=out)
    rights = ",".join(str(g.context_right) for g in modes)
    chunks = "/".join(f"{g.chunk_ms:.0f}" for g in modes)
    mixed = " in one engine" if len(modes) > 1 else ""
    print(f"{k}/{n} token-identical ({served.name}, context-right {rights} = {chunks} ms{mixed}, {dtype}, {device}, decoder {decoder_name(served.device)})", file=out, flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps([
            {
                "name": o.utt.name,
                "language": o.utt.language,
                "context_right": served.geometry_for(o.utt.context_right).context_right,
                "reference": o.utt.text,
                "identical": o.identical,
                "engine_token_ids": o.engine_ids,
                "engine_text": o.engine_text,
                "oracle_token_ids": o.oracle_ids,
                "oracle_text": o.oracle_text,
            }
            for o in outcomes
        ], indent=1))
    return 0 if k == n else 1
