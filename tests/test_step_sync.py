"""run_step waits for the device once: counted on CPU by following which tensors would live on it.

A TorchFunctionMode marks as "device" the model's parameters, the slot pool, the stepper's device
buffers and the step's input tensors, and everything computed from them; the stepper's and pool's
host staging buffers (pinned on CUDA) and their views as "staging". It then counts what would make
the host wait on a GPU: a device tensor read by the host (.item, .tolist, .cpu, .numpy, bool(),
int(), nonzero), a device tensor written into host memory (copy_, setitem, in-place ops, out=),
and host data copied to the device other than from a staging buffer (a pageable copy blocks),
including a device tensor indexed with host indices (a list, an array, a host tensor).
NeMo's label-looping decoder is excluded: on CPU it runs `torch_impl`, whose `while mask.any()`
syncs per label; on CUDA the stepper runs its CUDA-graph mode instead, which has none.

Copies from staging count as non-blocking: on CPU the code passes non_blocking=False (there is
nothing to overlap), so the counter cannot check the flag, only where the data comes from.

Two scopes: `run_step` alone, and the engine's whole iteration as the engine core drives it
(take_audio, finish, iterate with updates=True: scheduler, features, step, results).
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from nemo_serve.engine.step import StepBatch, run_step, stepper_for

from . import helpers


@pytest.fixture(autouse=True)
def _nemo_decoder(monkeypatch):
    """The one wait per step is a property of CUDA's default decoder, NeMo's computer (its graph has
    no host sync). Our label loop (engine/label_loop.py, the CPU's default) syncs once per label
    trip by design, so these tests run NeMo's."""
    monkeypatch.setenv("NEMO_SERVE_DECODER", "nemo")

HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
}
WRITES = {torch.Tensor.copy_, torch.Tensor.__setitem__}
FACTORIES_WITH_DATA = {torch.tensor, torch.as_tensor}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _host_index(index) -> bool:
    """An index that must be copied to the device first: a list, an array, or a non-scalar tensor
    (a device tensor is excluded by the caller). Ints, slices, None and Ellipsis are arguments."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (list, np.ndarray)) or (isinstance(p, torch.Tensor) and p.dim() > 0) for p in parts)


def _to_device(args, kwargs) -> bool:
    """Tensor.to with a device (not only a dtype)."""
    return any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs


class IdSet:
    """Tensors by identity, held weakly (a WeakSet compares tensors with ==)."""

    def __init__(self, tensors=()) -> None:
        self._refs: dict[int, weakref.ref] = {}
        for t in tensors:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        r = self._refs.get(id(t))
        return r is not None and r() is t


class SyncCounter(TorchFunctionMode):
    def __init__(self, device_tensors, staging_tensors) -> None:
        super().__init__()
        self.device = IdSet(device_tensors)
        self.staging = IdSet(staging_tensors)
        self.paused = 0
        self.d2h: list[str] = []  # device data into host memory: each one a wait
        self.host_reads: list[str] = []  # the host reads a device tensor: a wait
        self.h2d_unstaged: list[str] = []  # pageable host data to the device: a blocking copy

    def _is_dev(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.device

    def _is_staging(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.staging

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        name = getattr(func, "__name__", str(func))
        in_place = func in WRITES or (name.endswith("_") and not name.startswith("__")) or "out" in kwargs
        counting = not self.paused
        if counting:
            if func in INDEXING and self._is_dev(args[0]) and not self._is_dev(args[1]) and _host_index(args[1]):
                self.h2d_unstaged.append(name + "[host index]")
            if func in HOST_READS and inputs and self._is_dev(inputs[0]):
                self.host_reads.append(name)
            elif in_place:
                dst = kwargs.get("out", args[0] if args else None)
                srcs = [x for x in inputs if x is not dst]
                if func is torch.Tensor.__setitem__:  # the value; a host index is counted above
                    srcs = [args[2]] if isinstance(args[2], torch.Tensor) else []
                if isinstance(dst, torch.Tensor) and not self._is_dev(dst) and any(map(self._is_dev, srcs)):
                    self.d2h.append(name)
                if self._is_dev(dst) and func in WRITES:
                    for src in srcs:
                        if not self._is_dev(src) and not self._is_staging(src):
                            self.h2d_unstaged.append(name)
            elif func is torch.Tensor.to and inputs and not self._is_dev(inputs[0]):
                if _to_device(args, kwargs) and not self._is_staging(inputs[0]):
                    self.h2d_unstaged.append(name)
            elif func in FACTORIES_WITH_DATA and "device" in kwargs and not isinstance(args[0], (int, float)):
                self.h2d_unstaged.append(name)
        out = func(*args, **kwargs)
        if not in_place and func not in (torch.Tensor.cpu, torch.Tensor.numpy):  # those land on the host
            dev = any(map(self._is_dev, inputs)) or (not inputs and "device" in kwargs)
            dev = dev or (func is torch.Tensor.to and _to_device(args, kwargs))  # now on the device
            stg = not dev and any(map(self._is_staging, inputs))
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    if dev:
                        self.device.add(o)
                    elif stg:
                        self.staging.add(o)
        return out

    def total_waits(self) -> int:
        return len(self.d2h) + len(self.host_reads) + len(self.h2d_unstaged)

    def waits(self) -> list[str]:
        return [f"d2h {n}" for n in self.d2h] + [f"read {n}" for n in self.host_reads] + [
            f"h2d {n}" for n in self.h2d_unstaged]  # fmt: skip


def _counter(m, eng, extra_device=()):
    pool, st = eng.pool, stepper_for(m, eng.encoder, eng.pool)
    dev = [*m.nemo.parameters(), *m.nemo.buffers(), *m.preprocessor.buffers(), *pool._slot_tensors(),
           pool._channel_buf, pool._reset_dev,
           *pool._sos.predictor_states, pool._sos.predictor_outputs, pool._sos.labels,
           st.d_rows, st.d_lens, st.d_langs, st.d_feat, st.d_out, *extra_device]
    for w, b in getattr(eng.encoder, "_qkv", []):
        dev += [w] + ([b] if b is not None else [])
    for ps in getattr(eng.encoder, "_pos", {}).values():
        dev += ps
    counter = SyncCounter(dev, [*st.host_buffers, pool._reset_host, *eng.features.host_buffers])
    computer = st.computer

    def paused_computer(bucket):
        c = computer(bucket)

        def call(**kw):
            counter.paused += 1
            try:
                return c(**kw)
            finally:
                counter.paused -= 1

        return call

    st.computer = paused_computer
    return counter


@pytest.mark.parametrize("rows_as", ["numpy", "device tensor"])
@pytest.mark.parametrize("spec", [None, "builtin:tiny-prompt"])
def test_run_step_waits_for_the_device_exactly_once(spec, rows_as):
    m = helpers.model(spec, 3)
    eng = helpers.bare_engine(m, 8)
    pool, g = eng.pool, m.geometry
    for i in range(6):
        pool.open_row(i, language_index=i % 2)
    pool.close_row(5)  # a freed row: its reset is part of the next step, sync-free
    torch.manual_seed(0)
    with torch.inference_mode():
        # warm the stepper and the encoder's lazy caches, outside the count
        run_step(m, eng.encoder, pool, StepBatch(np.array([0]), torch.zeros(1, m.num_mels, g.first_frames), [g.first_frames], True, None))
        for is_first, width, widths in [(True, g.first_frames, [g.first_frames] * 3),
                                        (False, g.chunk_frames, [g.chunk_frames, 5, g.chunk_frames])]:
            feats = torch.randn(3, m.num_mels, width)
            slots = np.array([1, 2, 3])
            rows = slots if rows_as == "numpy" else torch.from_numpy(slots).to(m.device)
            langs = pool.languages.index_select(0, torch.from_numpy(slots)) if m.prompt_dictionary else None
            extra = [feats] + ([rows] if isinstance(rows, torch.Tensor) else []) + ([langs] if langs is not None else [])
            counter = _counter(m, eng, extra)
            with counter:
                result = run_step(m, eng.encoder, pool, StepBatch(rows, feats, widths, is_first, langs))
            assert len(result.token_ids) == 3
            assert counter.d2h == ["copy_"], counter.d2h  # the packed results, one copy
            assert counter.host_reads == [], counter.host_reads
            assert counter.h2d_unstaged == [], counter.h2d_unstaged
            del stepper_for(m, eng.encoder, pool).computer  # back to the class method


def test_the_counter_sees_each_kind_of_wait():
    """The count above can fail: each kind of wait, done on purpose, is seen."""
    m = helpers.model(None, 3)
    eng = helpers.bare_engine(m, 2)
    pool = eng.pool
    counter = _counter(m, eng)
    with counter:
        pool.decoded_lengths.tolist()  # the old step's lists
        n = int(pool.decoded_lengths[0])  # noqa: F841
        torch.zeros(3).copy_(pool.labels[:3])  # into pageable host memory
        pool.decoded_lengths[:2].copy_(torch.tensor([1, 2]))  # pageable host -> device
        torch.tensor([1, 2]).to(m.device)  # the old rows / lengths transfer
        torch.tensor([1, 2], device=m.device)
        (pool.labels[:2] + 1).cpu()
        pool.labels[[0, 1]] = 1  # the old mixed-width features: list-index assignment
        pool.labels[np.array([0, 1])]  # noqa: B018
        staged = stepper_for(m, eng.encoder, pool).host_buffers[0][:2].to(m.device)  # staged: not a wait
        staged.copy_(pool.labels[:2])  # now a device tensor: a device-to-device copy
    assert counter.host_reads == ["tolist", "__int__", "cpu"]
    assert counter.d2h == ["copy_"]
    assert counter.h2d_unstaged == ["copy_", "to", "tensor", "__setitem__[host index]", "__getitem__[host index]"]


def _drive_core_style(eng, audios, packet, start_tick, on_tick=None, abort_at=None):
    """As core/engine_core.py drives the engine: streams admitted on their slots, each tick one
    packet per stream handed over with take_audio (in two pieces, as a wrapped ring gives them),
    ends of input after the audio, then one iterate() whose updates are routed by slot.
    `on_tick(tick)` wraps the tick's work."""
    n = len(audios)
    updates = [[] for _ in range(n)]
    streams, pos, done = {}, [0] * n, set()
    for tick in range(1000):
        def work():
            for i in range(n):
                if tick == start_tick[i]:
                    streams[i] = eng.admit(slot=i, stream_id=f"s{i}")
                if i not in streams or i in done:
                    continue
                if abort_at is not None and abort_at == (i, tick):
                    eng.abort(streams[i], "test abort")
                    done.add(i)
                    continue
                part = audios[i][pos[i] : pos[i] + packet]
                pos[i] += len(part)
                half = len(part) // 2
                eng.take_audio(streams[i], (part[:half], part[half:]), time.time())
                if pos[i] >= len(audios[i]):
                    eng.finish(streams[i])
                    done.add(i)
            out = eng.iterate()
            for update, slot in zip(out.updates, out.update_slots):
                updates[slot].append(update)
            return out.busy

        busy = on_tick(tick, work) if on_tick is not None else work()
        if len(done) == n and not busy and not eng.loop_stream_ids:
            return updates
    raise AssertionError("streams did not finish")


@pytest.mark.parametrize("spec", [None, "builtin:tiny-prompt"])
def test_engine_iteration_waits_for_the_device_once_per_step(spec):
    """The engine's whole iteration as the engine core drives it (admit, take_audio, finish,
    iterate): scheduler, features (samples and lengths), rows, languages, the step and the
    results wait for the device once per device step, the step's packed-results copy. Covered:
    first chunks, later chunks, a first-chunk and a later-chunk group in one iteration, groups of
    unequal widths (final short chunks beside full ones), an abort, and freed slots reset."""
    m = helpers.model(spec, 3)
    eng = helpers.bare_engine(m, 8, token_confidence=True)
    g = m.geometry
    # Lengths that end on different phases of a chunk; audio arrives faster than it is stepped, so
    # a stream's short final chunk shares a group with the full chunks of the others.
    audios = [a[:k] for a, k in zip(helpers.utterances(4), (40100, 46000, 43500, 48000))]
    packet, start = 2 * g.chunk_frames * g.hop_samples, [0, 0, 0, 2]
    # Warm-up run, not counted: the steppers, the encoder's lazy caches, the staging sizes.
    warm = _drive_core_style(eng, audios, packet, start)
    assert all(u and u[-1].done for u in warm)

    st = stepper_for(m, eng.encoder, eng.pool)
    counter = _counter(m, eng)
    kinds, per_tick = [], []
    launch = eng._launch

    def spy(group):  # what each step was, for the coverage check below (host data only)
        kinds.append((group.is_first, len(set(group.widths.tolist())) > 1))
        return launch(group)

    eng._launch = spy

    def counted(tick, work):
        counter.d2h, counter.host_reads, counter.h2d_unstaged = [], [], []
        parts = st.parts
        with counter:
            busy = work()
        per_tick.append((counter.waits(), st.parts - parts))
        return busy

    try:
        counted_updates = _drive_core_style(eng, audios, packet, start, counted, abort_at=(3, 6))
    finally:
        del st.computer  # back to the class method
        del eng._launch
    # Same tokens as the warm-up run for the streams that were not aborted (the count changed nothing).
    for i in range(3):
        assert [t for u in counted_updates[i] for t in u.new_token_ids] == [t for u in warm[i] for t in u.new_token_ids]
    assert not any(u.done for u in counted_updates[3])  # aborted: nothing after the abort
    assert (True, False) in kinds and (False, False) in kinds and (False, True) in kinds, kinds
    assert any(parts == 2 for _, parts in per_tick), "no iteration with two steps"
    for waits, parts in per_tick:
        assert waits == ["d2h copy_"] * parts, (waits, parts)


def test_engine_prepare_is_a_no_op_on_cpu(monkeypatch):
    """Every server calls Engine.prepare() at start-up: on CPU it builds nothing; on CUDA it
    captures every graph (prepare_step, with the engine's confidence setting) and logs one line
    with the time and GPU memory. The CUDA branch's flow and line are checked here with the
    capture and the memory counters stubbed (the capture itself needs a GPU)."""
    from types import SimpleNamespace

    from nemo_serve.engine import loop

    m = helpers.model(None, 3)
    eng = helpers.bare_engine(m, 4, token_confidence=True)
    assert eng.prepare() is None
    assert not eng.pool.steppers  # nothing built on CPU
    calls = []

    def fake_prepare_step(model, encoder, pool, confidence=False):
        calls.append(confidence)
        return [stepper_for(m, encoder, pool, mode) for mode in m.modes]

    monkeypatch.setattr(loop, "prepare_step", fake_prepare_step)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * 2**30)
    monkeypatch.setattr(eng, "model", SimpleNamespace(device=torch.device("cuda")))
    line = eng.prepare()
    assert calls == [True]  # the decoders the engine runs: with token confidence
    assert line.startswith("CUDA graphs captured at start-up in ") and "0 encoder graphs over 1 mode(s)" in line, line
    assert "allocated 3.00 GiB (+0.00), reserved 4.00 GiB (+0.00)" in line, line
