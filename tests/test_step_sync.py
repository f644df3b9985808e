"""run_step waits for the device once: counted on CPU by following which tensors would live on it.

A TorchFunctionMode marks as "device" the model's parameters, the slot pool, the stepper's device
buffers and the step's input tensors, and everything computed from them; the stepper's and pool's
host staging buffers (pinned on CUDA) and their views as "staging". It then counts what would make
the host wait on a GPU: a device tensor read by the host (.item, .tolist, .cpu, .numpy, bool(),
int(), nonzero), a device tensor written into host memory (copy_, setitem, in-place ops, out=),
and host data copied to the device other than from a staging buffer (a pageable copy blocks).
NeMo's label-looping decoder is excluded: on CPU it runs `torch_impl`, whose `while mask.any()`
syncs per label; on CUDA the stepper runs its CUDA-graph mode instead, which has none.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from nemo_serve.engine.step import StepBatch, run_step, stepper_for

from . import helpers

HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
}
WRITES = {torch.Tensor.copy_, torch.Tensor.__setitem__}
FACTORIES_WITH_DATA = {torch.tensor, torch.as_tensor}


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
            if func in HOST_READS and inputs and self._is_dev(inputs[0]):
                self.host_reads.append(name)
            elif in_place:
                dst = kwargs.get("out", args[0] if args else None)
                srcs = [x for x in inputs if x is not dst]
                if isinstance(dst, torch.Tensor) and not self._is_dev(dst) and any(map(self._is_dev, srcs)):
                    self.d2h.append(name)
                if self._is_dev(dst) and func in WRITES:
                    for src in srcs:
                        if not self._is_dev(src) and not self._is_staging(src):
                            self.h2d_unstaged.append(name)
            elif func is torch.Tensor.to and inputs and not self._is_dev(inputs[0]):
                if any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs:
                    self.h2d_unstaged.append(name)
            elif func in FACTORIES_WITH_DATA and "device" in kwargs and not isinstance(args[0], (int, float)):
                self.h2d_unstaged.append(name)
        out = func(*args, **kwargs)
        if not in_place and func not in (torch.Tensor.cpu, torch.Tensor.numpy):  # those land on the host
            dev = any(map(self._is_dev, inputs)) or (not inputs and "device" in kwargs)
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


def _counter(m, eng, extra_device=()):
    pool, st = eng.pool, stepper_for(m, eng.encoder, eng.pool)
    dev = [*m.nemo.parameters(), *m.nemo.buffers(), *pool._slot_tensors(), pool._channel_buf, pool._reset_dev,
           *pool._sos.predictor_states, pool._sos.predictor_outputs, pool._sos.labels,
           st.d_rows, st.d_lens, st.d_langs, st.d_feat, st.d_out, *extra_device]
    for w, b in getattr(eng.encoder, "_qkv", []):
        dev += [w] + ([b] if b is not None else [])
    for ps in getattr(eng.encoder, "_pos", {}).values():
        dev += ps
    counter = SyncCounter(dev, [*st.host_buffers, pool._reset_host])
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
    eng = helpers.new_engine(m, 8)
    pool, g = eng.pool, m.geometry
    for i in range(6):
        pool.allocate(f"s{i}", language_index=i % 2)
    pool.free("s5")  # a freed row: its reset is part of the next step, sync-free
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
    eng = helpers.new_engine(m, 2)
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
    assert counter.host_reads == ["tolist", "__int__", "cpu"]
    assert counter.d2h == ["copy_"]
    assert counter.h2d_unstaged == ["copy_", "to", "tensor"]
