"""The ring layout (engine/ring_cache.py) against the window layout it replaces, in lockstep.

Two engines, one per layout, get the same calls; after every iteration every slot's encoder caches
(read back through `read_encoder` in the window layout's order) must be equal bit for bit, and
every stream's tokens identical. Streams join at different ticks, in every trained mode mixed in one
pool, one is aborted, and slots are reused. Token identity with NeMo's loop is test_parity.py's,
which runs the ring layout (the CPU's default).
"""

import pytest
import torch

from nemo_serve.core import inproc
from nemo_serve.engine import accounting, admission, loop, publish
from nemo_serve.engine.encoder import KVCacheEncoder, RingKVEncoder, make_encoder
from nemo_serve.engine.ring_cache import (
    INDEX_LIMIT, RingSlotPool, make_slot_pool, max_ring_step_rows, ring_layout_enabled,
)

from . import helpers


class _Clock:
    """One clock for both engines: the scheduler orders modes by wall-clock deadlines, so two
    engines on the real clock may step different groups in the same iteration."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    perf_counter = monotonic = time

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Lockstep:
    """The harness calls of helpers.drive, made on both engines; caches compared after each iteration."""

    def __init__(self, m, num_slots: int) -> None:
        self.ring = helpers.new_engine(m, num_slots)
        self.window = helpers.new_engine(m, num_slots)
        for e, ring in ((self.ring.engine, True), (self.window.engine, False)):
            e.encoder = make_encoder(m, ring=ring)
            e.pool = make_slot_pool(m, e.encoder, num_slots)
        w = self.window.engine
        assert isinstance(self.ring.engine.pool, RingSlotPool) and type(w.encoder) is KVCacheEncoder
        self.window_tokens: dict[int, list[int]] = {}
        self.steps_compared = 0
        self.c = w.encoder.cache_len

    def open_stream(self, on_result, **kw):
        h = self.ring.open_stream(on_result, **kw)
        key = len(self.window_tokens)
        self.window_tokens[key] = []
        return h, self.window.open_stream(lambda r: self.window_tokens[key].extend(r.new_token_ids), **kw)

    def push(self, hs, samples):
        for e, h in zip((self.ring, self.window), hs):
            e.push(h, samples)

    def finish(self, hs):
        for e, h in zip((self.ring, self.window), hs):
            e.finish(h)

    def abort(self, hs, reason):
        for e, h in zip((self.ring, self.window), hs):
            e.abort(h, reason)

    def iterate(self):
        self.clock.now += 0.05
        self.ring.iterate(), self.window.iterate()
        rows = torch.arange(self.ring.engine.num_slots)
        a = self.ring.engine.pool.read_encoder(rows)
        b = self.window.engine.pool.read_encoder(rows, self.c)
        for x, y in zip((a.cache_last_channel, a.cache_last_time, a.cache_last_channel_len),
                        (b.cache_last_channel, b.cache_last_time, b.cache_last_channel_len)):  # fmt: skip
            assert x.shape == y.shape and torch.equal(x, y), f"caches differ after {self.steps_compared} iterations"
        self.steps_compared += 1


def _run(spec, modes, dtype, num_slots=3, n=6):
    m = helpers.model(spec, modes, dtype=dtype)
    pair = _Lockstep(m, num_slots)
    pair.clock = _Clock()
    with pytest.MonkeyPatch.context() as mp:
        for module in (loop, admission, publish, accounting, inproc):  # the engine's modules, one clock
            mp.setattr(module, "time", pair.clock)
        return _drive(m, pair, n)


def _drive(m, pair, n):
    audios = [a[: 16000 * 3] for a in helpers.utterances(n, seed=3)]
    trained = list(m.modes)
    driven = helpers.drive(
        pair, audios, packet=[1600, 4000, 800], start_tick=[0, 1, 4, 40, 41, 75][:n],
        modes=[trained[i % len(trained)] for i in range(n)], abort={1: 12},
    )  # fmt: skip
    for i in range(n):
        assert driven.tokens(i) == pair.window_tokens[i], f"stream {i}"
    assert sum(map(len, pair.window_tokens.values())) > 0
    helpers.assert_engine_empty(pair.ring)
    assert pair.steps_compared > 50
    return pair


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ring_equals_window_every_step_demo_every_mode(dtype):
    """Six streams over three slots (reused twice), every trained mode of the demo model in one pool."""
    _run(None, "all", dtype)


@pytest.mark.parametrize("spec,dtype", [("builtin:tiny-hybrid", "fp32"), ("builtin:tiny-hybrid", "bf16"),
                                        ("builtin:tiny-prompt", "fp32")])  # fmt: skip
def test_ring_equals_window_every_step_builtins(spec, dtype):
    _run(spec, "all", dtype)


def test_ring_equals_window_every_step_larger_builtin():
    """FastConformer-L's architecture (17 layers, d 512, random weights), every trained mode."""
    _run("builtin:fastconformer-l", "all", "fp32", n=4)


def test_ring_pool_writes_only_new_frames_and_refuses_64_bit_pools():
    """A step leaves every ring position outside its new frames untouched (the window layout would
    rewrite all C), and a pool whose layer passes 2^31 elements is refused at start-up."""
    m = helpers.model("builtin:tiny-hybrid", None)
    enc = make_encoder(m, ring=True)
    assert isinstance(enc, RingKVEncoder)
    pool = make_slot_pool(m, enc, 2)
    g = m.geometry
    rows = torch.tensor([0, 1])
    feats = torch.randn(2, m.num_mels, g.first_frames)
    lens = torch.full((2,), g.first_frames)
    with torch.inference_mode():
        enc.step_in_place(feats, lens, pool, rows, 0, True)
        before = [k.clone() for k in pool.kv_layers]
        frames = pool.ring_frames.clone()
        feats = torch.randn(2, m.num_mels, g.pre_cache_frames + g.chunk_frames)
        lens = torch.full((2,), feats.shape[-1])
        enc.step_in_place(feats, lens, pool, rows, g.drop_frames, True)
    t = g.encoder_frames
    for k0, k1 in zip(before, pool.kv_layers):
        changed = (k0 != k1).any(dim=-1).any(dim=1)  # [S+1, R] ring positions written
        for slot in (0, 1):
            start = int(frames[slot])
            expected = {(start + enc.cache_len + j) % pool.ring for j in range(t)}
            assert set(changed[slot].nonzero().flatten().tolist()) == expected
    per_slot = pool.kv_layers[0][0].numel()
    with pytest.raises(ValueError, match="2\\^31"):
        RingSlotPool(m, INDEX_LIMIT // per_slot + 1, enc.channel_shape, enc.cache_len)


def test_layout_env_picks_the_reference(monkeypatch):
    m = helpers.model("builtin:tiny-hybrid", None)
    monkeypatch.delenv("NEMO_SERVE_KV_LAYOUT", raising=False)
    assert type(make_encoder(m)) is RingKVEncoder  # the CPU's default
    assert not ring_layout_enabled(torch.device("cuda"))  # CUDA's until a GPU run checks it
    monkeypatch.setenv("NEMO_SERVE_KV_LAYOUT", "window")
    assert type(make_encoder(m)) is KVCacheEncoder
    monkeypatch.setenv("NEMO_SERVE_KV_LAYOUT", "ring")
    assert type(make_encoder(m)) is RingKVEncoder
    monkeypatch.setenv("NEMO_SERVE_KV_LAYOUT", "paged")
    with pytest.raises(ValueError, match="ring or window"):
        make_encoder(m)


def test_ring_steps_are_capped_for_activations_not_cache(monkeypatch):
    """The window layout's 4 GiB step-cache budget does not bound the ring layout; its steps are
    capped at NEMO_SERVE_MAX_STEP_ROWS (default 2,048) rows."""
    m = helpers.model("builtin:tiny-hybrid", None)
    enc = make_encoder(m, ring=True)
    monkeypatch.setenv("NEMO_SERVE_STEP_CACHE_BYTES", "1")  # the window layout's budget: 1 row per step
    assert make_slot_pool(m, make_encoder(m, ring=False), 8).max_step_rows == 1
    assert make_slot_pool(m, enc, 8).max_step_rows == 8
    assert max_ring_step_rows() == 2048
    monkeypatch.setenv("NEMO_SERVE_MAX_STEP_ROWS", "4")
    assert make_slot_pool(m, enc, 8).max_step_rows == 4
