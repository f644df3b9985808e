"""Factories shared by the engine tests: models, audio, a deterministic single-thread driver."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from nemo_serve.engine.endpoint import EndpointConfig
from nemo_serve.core.inproc import LocalEngine
from nemo_serve.engine.loop import Engine
from nemo_serve.model import load_model
from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances, synthetic_utterances


@functools.lru_cache(maxsize=8)
def model(spec: str | None = None, context_right: int | None = None, dtype: str = "fp32"):
    return load_model(spec, context_right=context_right, dtype=dtype)


def utterances(n: int, sample_rate: int = 16000, seed: int = 0) -> list[np.ndarray]:
    """Bundled demo utterances when shipped, else deterministic synthetic ones."""
    if BUNDLED_MANIFEST.exists():
        pool = [u.audio for u in load_utterances(BUNDLED_MANIFEST, sample_rate)]
        return [pool[(seed + i) % len(pool)] for i in range(n)]
    return [u.audio for u in synthetic_utterances(n, sample_rate, seed)]


@dataclass
class Driven:
    results: list[list] = field(default_factory=list)

    def tokens(self, i: int) -> list[int]:
        return [t for r in self.results[i] for t in r.new_token_ids]

    def finals(self, i: int) -> list:
        return [r for r in self.results[i] if r.is_final]


def drive(
    engine: LocalEngine,
    audios: list[np.ndarray],
    *,
    packet: int | list[int] = 1600,
    start_tick: list[int] | None = None,
    languages: list[str | None] | None = None,
    modes: list[int | None] | None = None,
    abort: dict[int, int] | None = None,
    max_ticks: int = 100000,
    phrases: list[tuple[list[str], float] | None] | None = None,
) -> Driven:
    """Step-synchronous clients: stream i opens at tick start_tick[i] (in chunk mode modes[i]) and
    pushes one packet per tick; the engine iterates once per tick on this thread. `abort` maps
    stream -> tick of abort. `phrases[i]`: stream i's (phrases, boost), or None."""
    n = len(audios)
    start_tick = start_tick or [0] * n
    languages = languages or [None] * n
    modes = modes or [None] * n
    abort = abort or {}
    phrases = phrases or [None] * n
    out = Driven([[] for _ in range(n)])
    sizes = packet if isinstance(packet, list) else [packet]
    streams, pos = {}, [0] * n
    finished = set()
    for tick in range(max_ticks):
        for i in range(n):
            if tick == start_tick[i]:
                boost = dict(zip(("phrases", "boost"), phrases[i])) if phrases[i] else {}
                streams[i] = engine.open_stream(out.results[i].append, language=languages[i], context_right=modes[i],
                                                **boost)  # fmt: skip
            if i in streams and i not in finished:
                if abort.get(i) == tick:
                    engine.abort(streams[i], "test abort")
                    finished.add(i)
                    continue
                k = sizes[(tick + i) % len(sizes)]
                engine.push(streams[i], audios[i][pos[i] : pos[i] + k])
                pos[i] += k
                if pos[i] >= len(audios[i]):
                    engine.finish(streams[i])
                    finished.add(i)
        engine.iterate()
        if len(finished) == n and all(
            (i in abort) or (out.results[i] and out.results[i][-1].done) for i in range(n)
        ):
            engine.iterate()  # release
            return out
    raise AssertionError("streams did not finish")


def assert_engine_empty(engine: LocalEngine | Engine) -> None:
    """No slot or stream left behind (in the harness and in its Engine)."""
    engine.iterate()
    assert engine.num_open_streams == 0
    if isinstance(engine, LocalEngine):
        assert engine.num_free_slots == engine.num_slots and engine.open_by_mode() == {}
        engine = engine.engine
    assert engine.num_open_streams == 0 and engine.slots.num_free == engine.num_slots
    assert not engine.slots.held.any() and not engine.pool.boosted.any()
    assert not engine.loop_stream_ids and engine.check_accounting() == 0
    assert engine.audio_arena.num_in_use == 0  # every buffer's row given back (engine/frontend.py AudioArena)


def new_engine(m, num_slots: int = 8, endpoint: EndpointConfig | None = None, max_queue_delay_s: float = 0.0,
               **kw) -> LocalEngine:  # fmt: skip
    """The in-process engine (core/inproc.py): open_stream, push, iterate on this thread."""
    return LocalEngine(bare_engine(m, num_slots, endpoint, **kw), max_queue_delay_s=max_queue_delay_s)


def bare_engine(m, num_slots: int = 8, endpoint: EndpointConfig | None = None, **kw) -> Engine:
    """The Engine alone, as an engine core drives it: admit(slot=...), take_audio, iterate."""
    return Engine(m, num_slots=num_slots, endpoint=endpoint or EndpointConfig.off(), **kw)


def chunk_signal(g, history, idx, feats, is_first: bool):
    """A chunk's encoder input as the engine builds it: a first chunk alone (drop 0), a later one after
    its rows' last pre-cache frames (drop g.drop_frames). `history` [rows, mels, pre_cache] is updated in
    place. Returns (signal, drop, lengths)."""
    import torch

    signal, drop = feats, 0
    if not is_first:
        signal, drop = torch.cat([history[idx], feats], dim=-1), g.drop_frames
    history[idx] = torch.cat([history[idx], feats], dim=-1)[:, :, -g.pre_cache_frames :]
    lengths = torch.full((len(idx),), signal.shape[-1], dtype=torch.long)
    return signal, drop, lengths
