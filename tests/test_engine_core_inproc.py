"""One engine core class behind both transports (core/engine_core.py): the in-process engine
(core/inproc.py) and the ZMQ process loop (core/core_proc.py) deliver the same updates in the same
order for the same scripted inputs, and both free a stream's slot before its `done` is delivered."""

from __future__ import annotations

import tempfile

import msgspec
import numpy as np
import pytest
import zmq

from nemo_serve.core import messages as m
from nemo_serve.core.addresses import control_address, results_address
from nemo_serve.core.core_proc import EngineCoreProc
from nemo_serve.core.shared import FREE, FileLock, SharedLayout, SharedSlots
from nemo_serve.engine.endpoint import EndpointConfig

from . import helpers
from .helpers_server import TEST_MODEL

PACKET = 1600
# Stream i: (its audio's seed, the tick it opens at, the tick it is aborted at or None).
SCRIPT = [(0, 0, None), (1, 0, None), (2, 3, None), (3, 1, 6), (4, 9, None)]


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


def _script_ticks(audios):
    """Per tick, the calls a front end makes: ("open", i), ("push", i, samples), ("finish", i), ("abort", i)."""
    pos, done, ticks = [0] * len(SCRIPT), set(), []
    while len(done) < len(SCRIPT):
        t, calls = len(ticks), []
        for i, (_, start, abort_at) in enumerate(SCRIPT):
            if t < start or i in done:
                continue
            if t == start:
                calls.append(("open", i))
            if t == abort_at:
                calls.append(("abort", i))
                done.add(i)
                continue
            calls.append(("push", i, audios[i][pos[i] : pos[i] + PACKET]))
            pos[i] += PACKET
            if pos[i] >= len(audios[i]):
                calls.append(("finish", i))
                done.add(i)
        ticks.append(calls)
    return ticks + [[]] * 40  # then iterate until every stream has ended


def _key(update) -> tuple:
    """An update without its clock readings (arrival, latency), which differ between runs."""
    return tuple((k, v) for k, v in sorted(msgspec.structs.asdict(update).items()) if k != "audio_arrival_time")


def _run_in_process(model, ticks, num_slots):
    eng = helpers.new_engine(model, num_slots=num_slots, endpoint=EndpointConfig())
    got, handles = [], {}
    free_at_done = []

    def consumer(update):
        got.append(_key(update))
        if update.done:  # the slot is free by the time the stream's last update is delivered
            free_at_done.append(eng.slots.owner[handles[update.stream_id].slot] == FREE)

    for calls in ticks:
        for call in calls:
            op, i = call[0], call[1]
            if op == "open":
                handles[f"s{i}"] = eng.open_stream(consumer, stream_id=f"s{i}", updates=True)
            elif op == "push":
                eng.push(handles[f"s{i}"], call[2])
            elif op == "finish":
                eng.finish(handles[f"s{i}"])
            else:
                eng.abort(handles[f"s{i}"], "scripted")
        eng.iterate()
    helpers.assert_engine_empty(eng)
    return got, free_at_done


def _run_over_zmq(model, ticks, num_slots):
    """The same calls as a front end makes them (core/client.py): a slot allocated in shared
    memory, samples written to its ring and announced by Wrote, control messages over ZMQ."""
    ipc_dir = tempfile.mkdtemp(prefix="ns-inproc-")
    shared = SharedSlots.create(SharedLayout(num_slots, 16000 * 4), FileLock(f"{ipc_dir}/lock"))
    ctx = zmq.Context()
    proc = EngineCoreProc(helpers.bare_engine(model, num_slots, EndpointConfig()), shared, ipc_dir, ctx)
    control, results = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    results.bind(results_address(ipc_dir, 0))
    control.connect(control_address(ipc_dir))
    got, slots, written = [], {}, {}
    try:
        for calls in ticks:
            sent = []
            for call in calls:
                op, i = call[0], call[1]
                if op == "open":
                    slots[i] = shared.allocate(0)
                    written[i] = 0
                    sent.append(m.Open(*slots[i], 0, f"s{i}", 0, {}))
                elif op == "push":
                    shared.write(slots[i][0], written[i], call[2])
                    written[i] += len(call[2])
                    sent.append(m.Wrote(*(np.array([v], t).tobytes() for v, t in
                                          ((slots[i][0], m.SLOT), (slots[i][1], m.GEN), (written[i], m.POS), (0.0, m.TIME)))))  # fmt: skip
                elif op == "finish":
                    sent.append(m.Finish(*slots[i]))
                else:
                    sent.append(m.Abort(*slots[i], "scripted"))
            for msg in sent:
                control.send(m.control_encoder.encode(msg))
            taken = 0
            while taken < len(sent):  # every message of the tick in before the step, as in process
                proc.control.poll(1000)
                taken += proc.take_control()
            proc.step()
            while results.poll(0):  # what has arrived; the rest is drained at the end, in order
                for u in m.results_decoder.decode(results.recv()).updates:
                    got.append(_key(u))
        while results.poll(500):
            got.extend(_key(u) for u in m.results_decoder.decode(results.recv()).updates)
        assert shared.num_free == num_slots and proc.core.check_invariants() == 0
    finally:
        proc.close()
        control.close(0)
        results.close(0)
        ctx.term()
        shared.close()
    return got


def test_in_process_and_zmq_core_deliver_the_same_updates_in_the_same_order(tiny):
    audios = [helpers.utterances(1, seed=seed)[0][: 16000 * 3] for seed, _, _ in SCRIPT]
    ticks = _script_ticks(audios)
    in_process, free_at_done = _run_in_process(tiny, ticks, num_slots=4)
    over_zmq = _run_over_zmq(tiny, ticks, num_slots=4)
    assert len(in_process) > 10 and sum(dict(u)["done"] for u in in_process) == len(SCRIPT) - 1  # one aborted
    assert in_process == over_zmq
    assert free_at_done and all(free_at_done)


def test_a_done_callback_can_open_the_next_stream_on_the_freed_slot(tiny):
    """What a realtime session does at a committed item's `done`: open the next item. With one
    slot, that works only if the slot is free before `done` is delivered (the core's order; the
    old harness delivered first and this open failed with NoFreeSlotError)."""
    eng = helpers.new_engine(tiny, num_slots=1)
    audio = helpers.utterances(1)[0][:16000]
    opened = []

    def on_result(r):
        if r.done and not opened:
            opened.append(eng.open_stream(lambda r: None))

    s = eng.open_stream(on_result)
    eng.push(s, audio)
    eng.finish(s)
    for _ in range(100):
        eng.iterate()
        if opened:
            break
    assert opened and eng.num_free_slots == 0
    eng.abort(opened[0])
    helpers.assert_engine_empty(eng)
