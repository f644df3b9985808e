"""The diarizer step launched with the ASR step and collected after it (engine/loop.py, diarization/runner.py).

With overlap on, an iteration launches the diarizer's step behind the ASR steps and collects it in the
next iteration; its widths and branches are decided on the host (diarization/update.py plan_update),
so the launch reads nothing from the device. On a CPU the device work is done at launch, so, as in
tests/test_overlap.py, a stand-in device runs each diarizer step on one worker thread (in launch
order, as a device stream) for at least `device_s`, and a stand-in host adds `host_s` to each
diarizer step's feature computation. Then (a) the speakers are the sequential loop's: probabilities,
token, word and final speakers; (b) an abort while its step is in flight loses nothing else; (c) a
diarizer step costs about max(host, device) of wall time overlapped, their sum sequentially.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from nemo_serve.builtin.sortformer import build_diarizer
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings
from tests import helpers
from tests.helpers_diarization import _assert_empty, _drive, _kept_probabilities


@functools.lru_cache(maxsize=None)
def diarizer():
    model = build_diarizer("tiny-sortformer", 0)
    apply_settings(model, MODEL_CARD_SETTINGS["ultra_low"])  # short chunks: many steps on short audio
    return model


class ThreadDiarDevice:
    """The runner's device (diarization/runner.py InlineDevice) as one worker thread: each step runs
    there in launch order and takes at least `device_s`; `.result()` waits for it."""

    def __init__(self, device_s: float) -> None:
        self.device_s = device_s
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="stand-in-diarizer")

    def submit(self, fn, *args):
        return self.worker.submit(self._run, fn, args)

    def _run(self, fn, args):
        start = time.perf_counter()
        with torch.inference_mode():
            result = fn(*args)
        time.sleep(max(0.0, self.device_s - (time.perf_counter() - start)))
        return result


class SlowFeatures:
    """The diarizer's feature extractor, plus `host_s` of host work per chunk width."""

    def __init__(self, features, host_s: float) -> None:
        self.features, self.host_s = features, host_s

    def __getattr__(self, name):
        return getattr(self.features, name)

    def compute(self, *args, **kw):
        time.sleep(self.host_s)
        return self.features.compute(*args, **kw)


def _engine(num_slots: int, overlap: bool, device_s: float | None = None, host_s: float = 0.0):
    engine = helpers.new_engine(helpers.model(None), num_slots, diarizer=diarizer(), overlap=overlap)
    runner = engine.engine.diarizer
    if device_s is not None:
        runner.device = ThreadDiarDevice(device_s)
    if host_s:
        runner.features = SlowFeatures(runner.features, host_s)
    return engine


def _speakers(results) -> list[tuple]:
    """What a client sees of speakers, result by result."""
    return [(r.segment, r.is_final, r.done, r.new_token_ids, r.token_speakers, r.speaker, r.word_speakers,
             r.end_reason) for r in results]  # fmt: skip


AUDIOS = functools.partial(helpers.utterances, 3, seed=5)
OPTIONS = [{"max_speakers": 4}, {"max_speakers": 2, "split_on_speaker_change": True}, None]


def test_overlapped_diarizer_gives_the_sequential_speakers(monkeypatch):
    """Two diarized streams and a plain one, started at different ticks: with overlap on (diarizer
    steps on a stand-in device thread) every result, its token, word and final speakers equal the
    sequential loop's, every speaker decision too, and every speaker probability within the parity
    tolerance (2e-5): where the diarizer takes its frames from the ASR step (shared features), the
    two loops batch the ASR rows differently, and the mel product's summation order with them (a CI
    run differed there)."""
    kept = _kept_probabilities(monkeypatch)
    audios = AUDIOS()
    seq_results, seq_ids = _drive(_engine(3, overlap=False), audios, OPTIONS, packet=1234, start_tick=[0, 3, 1])
    seq_kept = {i: kept.pop(seq_ids[i]) for i in (0, 1)}
    engine = _engine(3, overlap=True, device_s=0.004)
    results, ids = _drive(engine, audios, OPTIONS, packet=1234, start_tick=[0, 3, 1])
    for i in range(3):
        assert _speakers(results[i]) == _speakers(seq_results[i]), i
    for i in (0, 1):
        got, want = kept[ids[i]], seq_kept[i]
        assert len(want) > 20 and got.shape == want.shape, i
        assert np.array_equal(got > 0.5, want > 0.5), i
        assert np.abs(got - want).max() <= 2e-5, (i, np.abs(got - want).max())
    assert any(len(set(r.token_speakers or ())) > 1 for r in seq_results[0]), "one speaker only: a weak check"
    _assert_empty(engine)


def test_an_abort_while_the_diarizer_step_is_in_flight_loses_nothing_else():
    """A diarized stream aborted while the diarizer has its step in flight: its rows of that step
    are dropped at collect, its diarizer slot is free, the other diarized stream's speakers are
    the sequential loop's."""
    audios = AUDIOS()[:2]
    options = OPTIONS[:2]
    seq_results, _ = _drive(_engine(2, overlap=False), audios, options, packet=1234)
    engine = _engine(2, overlap=True, device_s=0.004)
    runner, results, handles = engine.engine.diarizer, [[], []], []
    for i in range(2):
        handles.append(engine.open_stream(results[i].append, diarization=options[i]))
    aborted_in_flight = False
    for tick in range(10000):
        for i in range(2):
            if not (i == 0 and aborted_in_flight) and 1234 * tick < len(audios[i]):
                engine.push(handles[i], audios[i][1234 * tick : 1234 * (tick + 1)])
                if 1234 * (tick + 1) >= len(audios[i]):
                    engine.finish(handles[i])
        engine.iterate()
        if tick >= 8 and not aborted_in_flight and any(
                s.stream_id == handles[0].stream_id for step in runner.in_flight for s in step.streams):  # fmt: skip
            aborted = runner.streams[handles[0].stream_id]
            kept_before_abort = aborted.preds.num_frames
            engine.abort(handles[0])
            aborted_in_flight = True
        if results[1] and results[1][-1].done:
            engine.iterate()
            break
    assert aborted_in_flight
    assert aborted.preds.num_frames == kept_before_abort  # its rows of the step in flight were dropped at collect
    assert _speakers(results[1]) == _speakers(seq_results[1])
    assert not runner.in_flight
    _assert_empty(engine)


def test_a_diarizer_step_costs_the_larger_of_host_and_device_time_not_their_sum():
    """Diarized streams with all their audio there: every iteration has a diarizer step to launch.
    Its host work (`host_s`, in its features) and device work (`device_s`) are known; per diarizer
    step the overlapped loop takes about the larger, the sequential loop the sum (plus the ASR
    steps' real work, the same in both)."""
    host_s = device_s = 0.1
    audios = [a[: 16000 * 2] for a in AUDIOS()[:2]]
    per_step = {}
    for overlap in (False, True):
        engine = _engine(2, overlap=overlap, device_s=device_s, host_s=host_s)
        t0 = time.perf_counter()
        _drive(engine, audios, OPTIONS[:2], packet=16000 * 2)
        per_step[overlap] = (time.perf_counter() - t0) / engine.engine.diarizer.num_steps
        _assert_empty(engine)
    print(f"wall per diarizer step: sequential {per_step[False] * 1e3:.1f} ms, overlapped {per_step[True] * 1e3:.1f} ms "
          f"(host {host_s * 1e3:.0f} ms, device {device_s * 1e3:.0f} ms)")  # fmt: skip
    assert per_step[False] > 0.95 * (host_s + device_s), per_step
    assert per_step[False] - per_step[True] > 0.6 * min(host_s, device_s), per_step
    assert per_step[True] < 0.8 * (host_s + device_s), per_step
