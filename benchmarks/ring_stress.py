"""Cross-process stress check of the shared-memory audio rings (nemo_serve/core/shared.py), run by
tests/test_ring_stress.py and by benchmarks/ring_bench.py.

`stress()`: an EngineCoreProc in its own process, its Engine
replaced by `SequenceEngine`, which checks that every sample it is handed is the next number of its
stream's sequence; a front end (this process, the real EngineClient on asyncio) streams sequence-
numbered packets of random sizes into rings a little smaller than a packet, so that they wrap and
fill all the time, opens new streams on freed slots, and checks that every stream's end reports
all of its samples and no mismatch.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.sequence_engine import SequenceEngine, model_info, sequence  # noqa: E402


def _core_process(ipc_dir: str, shm_name: str, layout, lock, conn) -> None:
    from nemo_serve.core.core_proc import EngineCoreProc
    from nemo_serve.core.shared import SharedSlots

    shared = SharedSlots.attach(shm_name, layout, lock)
    core = EngineCoreProc(SequenceEngine(shared.num_slots, check=True), shared, ipc_dir)
    conn.send("serving")
    t0 = time.process_time()
    core.run(os.getppid())
    conn.send(time.process_time() - t0)
    core.close()
    shared.close()


async def _stream_all(client, num_slots: int, num_streams: int, max_packet: int, samples_per_stream: tuple[int, int],
                      rng: random.Random) -> tuple[dict, int]:  # fmt: skip
    """Every stream: sequence-numbered packets of random sizes, then its end; returns what each
    stream's last result said, and the packets sent."""
    done: dict[str, tuple[int, float, str | None]] = {}
    open_: dict[str, list] = {}  # stream id -> [handle, sent, total]
    next_id, packets = 0, 0
    ended = asyncio.Event()

    def on_result(total):
        def deliver(r) -> None:
            if r.done:
                done[r.stream_id] = (total, r.audio_processed_s, r.error)
                ended.set()

        return deliver

    while next_id < num_streams or open_:
        while len(open_) < num_slots and next_id < num_streams:  # a freed slot takes the next stream
            stream_id, total = f"stress-{next_id}", rng.randint(*samples_per_stream)
            try:
                h = client.open_stream(on_result(total), stream_id=stream_id)
            except Exception:  # noqa: BLE001 - NoFreeSlotError: the core has not freed the slot yet
                break
            open_[stream_id] = [h, 0, total]
            next_id += 1
        for stream_id in rng.sample(sorted(open_), k=len(open_)):
            entry = open_[stream_id]
            h, sent, total = entry
            if sent < total:
                n = min(rng.randint(1, max_packet), total - sent)
                client.push(h, sequence(stream_id, sent, n))
                entry[1] = sent + n
                packets += 1
            elif sent == total:
                client.finish(h)
                entry[1] = total + 1  # ended
            if stream_id in done:
                del open_[stream_id]
        if rng.random() < 0.5:
            await asyncio.sleep(0)  # one event-loop tick: several packets share one Wrote, or not
        else:
            ended.clear()
            try:
                await asyncio.wait_for(ended.wait(), 0.002)
            except asyncio.TimeoutError:
                pass
    return done, packets


def stress(num_slots: int = 6, num_streams: int = 24, ring_samples: int = 997, max_packet: int = 1500,
           samples_per_stream: tuple[int, int] = (20_000, 60_000), seed: int = 0, timeout_s: float = 300.0,
           positions_in_shared: bool = False) -> dict:  # fmt: skip
    """The engine core in a process of its own, the front end here; every sample of every stream
    checked; the ring positions in messages or in shared memory (core/shared.py). Returns {"streams", "packets", "samples", "bad": [(stream, why)], "seconds"}."""
    import zmq

    from nemo_serve.core import messages as m
    from nemo_serve.core.client import EngineClient
    from nemo_serve.core.addresses import control_address
    from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots

    ipc_dir = tempfile.mkdtemp(prefix="ring-stress-")
    layout = SharedLayout(num_slots, ring_samples, positions_in_shared)
    lock = FileLock(f"{ipc_dir}/slots.lock")
    shared = SharedSlots.create(layout, lock)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    core = ctx.Process(target=_core_process, args=(ipc_dir, shared.name, layout, lock, child), daemon=True)
    core.start()
    t0 = time.monotonic()
    try:
        if not parent.poll(120) or parent.recv() != "serving":
            raise RuntimeError("the engine core did not start")

        async def front_end():
            client = EngineClient(model_info(), shared, 0, ipc_dir).start()
            try:
                return await asyncio.wait_for(
                    _stream_all(client, num_slots, num_streams, max_packet, samples_per_stream, random.Random(seed)), timeout_s)
            finally:
                client.stop()

        done, packets = asyncio.run(front_end())
        stop = zmq.Context.instance().socket(zmq.PUSH)
        stop.connect(control_address(ipc_dir))
        stop.send(m.control_encoder.encode(m.Stop()))
        core_cpu_s = parent.recv() if parent.poll(30) else None
        stop.close(0)
    finally:
        core.join(10)
        if core.is_alive():
            core.kill()
        shared.close()
    bad = [(sid, f"{got:.0f} of {total} samples" if error is None else error)
           for sid, (total, got, error) in sorted(done.items()) if error is not None or got != total]  # fmt: skip
    missing = num_streams - len(done)
    if missing:
        bad.append(("-", f"{missing} streams got no last result"))
    return {"streams": len(done), "packets": packets, "samples": int(sum(t for t, _, _ in done.values())),
            "bad": bad, "seconds": round(time.monotonic() - t0, 1), "core_cpu_s": core_cpu_s}  # fmt: skip
