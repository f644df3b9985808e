"""The shared-memory audio rings (nemo_serve/core/shared.py): what publishing a packet costs, and a
cross-process stress check of every sample.

    python benchmarks/ring_bench.py --out benchmarks/results/ring_publication_cpu.json

Cost: CPU per packet (the whole process: both sides and the ZMQ I/O threads; and apart, the share
of the core's loop thread, the one that also runs the model) of handing 100 ms
packets from a front end to the engine core and the ring space back, with the Engine replaced by a
stub that only copies the samples out. `plain_stores` is the protocol the rings had before (the
front end stores its write position in shared memory after the samples, the core compares the
positions of every slot: correct on x86-64 only); `messages` is today's (core/client.py's Wrote,
one per event-loop tick, and the read ends in the core's Results), through the real EngineClient
and EngineCoreProc methods. `per_tick` packets are written between two core iterations, to as many
streams: 1 is a quiet server, where each packet pays for a message of its own. `shared` is the
positions in shared memory as the server keeps them on x86-64 now (core/shared.py: fenced stores,
no Wrote, no read ends in Results), through the same EngineClient and EngineCoreProc methods.

Stress (`stress()`, run by tests/test_ring_stress.py): an EngineCoreProc in its own process, its Engine
replaced by `SequenceEngine`, which checks that every sample it is handed is the next number of its
stream's sequence; a front end (this process, the real EngineClient on asyncio) streams sequence-
numbered packets of random sizes into rings a little smaller than a packet, so that they wrap and
fill all the time, opens new streams on freed slots, and checks that every stream's end reports
all of its samples and no mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nemo_serve.engine.outputs import IterationOutput, ReleasedStream, StepStats  # noqa: E402 - torch-free
from nemo_serve.engine.results import StreamUpdate  # noqa: E402 - torch-free
from nemo_serve.engine.slot_table import SlotTable  # noqa: E402 - torch-free

SEQUENCE_MOD = 1 << 24  # float32 holds every integer below it exactly


def sequence(stream_id: str, start: int, n: int) -> np.ndarray:
    """Samples [start, start + n) of the stream's sequence: a stream-specific offset, so a sample
    from another ring is caught as surely as a stale one from this ring's previous lap."""
    base = int(stream_id.rsplit("-", 1)[-1]) * 7919
    return ((base + start + np.arange(n, dtype=np.int64)) % SEQUENCE_MOD).astype(np.float32)


class _Stream:
    def __init__(self, stream_id: str, slot: int, check: bool) -> None:
        self.stream_id, self.slot, self.check = stream_id, slot, check
        self.taken = 0
        self.error: str | None = None
        self.arrived = 0.0


class SequenceEngine:
    """Stands in for the Engine inside an EngineCore (the calls EngineCore makes): copies every
    sample it is handed out of the ring, as the Engine does, and with `check` compares it with its
    stream's sequence; a stream's last update reports how many samples it took and the first
    mismatch."""

    def __init__(self, num_slots: int, check: bool = True) -> None:
        self.check = check
        self.num_slots = num_slots
        self.slots = SlotTable(num_slots)
        self._ending: list[_Stream] = []
        self._released: list[ReleasedStream] = []

    def admit(self, *, stream_id: str, slot: int, **_) -> _Stream:
        stream = _Stream(stream_id, slot, self.check)
        self.slots.take(stream, slot)
        return stream

    def take_audio(self, s: _Stream, parts, arrived: float) -> None:
        got = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        if s.check and s.error is None:
            want = sequence(s.stream_id, s.taken, len(got))
            bad = np.flatnonzero(got != want)
            if bad.size:
                i = int(bad[0])
                s.error = f"sample {s.taken + i}: got {got[i]:.0f}, sent {want[i]:.0f}"
        s.taken += len(got)
        s.arrived = arrived

    def take_audio_many(self, slots: np.ndarray, parts: list, arrivals: list[float]) -> None:
        """What EngineCore calls once per iteration (Engine.take_audio_many)."""
        for slot, pieces, arrived in zip(slots.tolist(), parts, arrivals):
            self.take_audio(self.slots.by_slot[slot], pieces, arrived)

    def finish(self, s: _Stream) -> None:
        self._ending.append(s)

    def abort(self, s: _Stream, reason: str = "aborted") -> None:
        self.slots.give_back(s)
        self._released.append(ReleasedStream(s.stream_id, s.slot))

    def force_final(self, s: _Stream) -> None:
        pass

    def iterate(self) -> IterationOutput:
        ending, self._ending = self._ending, []
        updates = tuple(
            StreamUpdate(s.stream_id, 0, True, True, [], [], 0, float(s.taken), s.arrived, error=s.error) for s in ending
        )
        for s in ending:
            self.slots.give_back(s)
        released = tuple(self._released) + tuple(ReleasedStream(s.stream_id, s.slot) for s in ending)
        self._released.clear()
        steps = tuple(StepStats(1, 0.0, 0) for _ in ending)  # busy: the core should not sleep
        return IterationOutput(updates, tuple(s.slot for s in ending), released, steps, (0.0, 0.0))


def model_info():
    """What an EngineClient needs of the model: nothing of it is used by the rings."""
    from nemo_serve.engine.geometry import ChunkGeometry, ModelInfo

    g = ChunkGeometry(70, 0, 1, 8, 9, 2, 1, 8, 160, 16000, 8)
    return ModelInfo("ring-bench", g, ["<blank>"], False, None, None, 400, "ring bench")


# ----------------------------------------------------------------------------- stress


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


# ----------------------------------------------------------------------------- cost


class _Tick:
    """Stands for the event loop in EngineClient: call_soon callbacks run when the tick ends."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def call_soon(self, fn, *args) -> None:
        self.callbacks.append((fn, args))

    def call_later(self, _delay_s: float, fn, *args) -> None:
        """At the tick's end too: the core iterates once per tick here, as if ticks were a Wrote
        period (client.WROTE_PERIOD_S) apart."""
        self.callbacks.append((fn, args))

    @staticmethod
    def time() -> float:
        return time.monotonic()

    def end(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        for fn, args in callbacks:
            fn(*args)


def _cost_messages(num_streams: int, per_tick: int, rounds: int, packet: np.ndarray, ipc_dir: str,
                   positions_in_shared: bool = False) -> tuple[float, float]:
    """(CPU s per packet, of which the core's loop thread) with today's rings, through
    EngineClient's and EngineCoreProc's own methods."""
    import zmq

    from nemo_serve.core import messages as m
    from nemo_serve.core.client import EngineClient
    from nemo_serve.core.addresses import results_address
    from nemo_serve.core.core_proc import EngineCoreProc
    from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots

    shared = SharedSlots.create(SharedLayout(num_streams, 4 * len(packet), positions_in_shared),
                                FileLock(f"{ipc_dir}/slots.lock"))  # fmt: skip
    core_ctx, fe_ctx = zmq.Context(), zmq.Context()
    core = EngineCoreProc(SequenceEngine(shared.num_slots, check=False), shared, ipc_dir, core_ctx)
    client = EngineClient(model_info(), shared, 0, ipc_dir)
    results = fe_ctx.socket(zmq.PULL)  # the client's own sockets, synchronous here
    results.bind(results_address(ipc_dir, 0))
    client._control = fe_ctx.socket(zmq.PUSH)
    client._control.connect(core.control.getsockopt_string(zmq.LAST_ENDPOINT))
    client._control_send = client._control.send  # what start() sets up
    tick = _Tick()
    client._loop = tick
    try:
        handles = [client.open_stream(lambda r: None, stream_id=f"cost-{i}") for i in range(num_streams)]
        while core.engine.slots.num_used < num_streams:
            core.control.poll(1000)
            core.iterate_once()
        cpu = core_cpu = 0.0
        for r in range(rounds + 1):
            t0 = time.process_time()
            for k in range(r * per_tick, (r + 1) * per_tick):
                client.push(handles[k % num_streams], packet)
            tick.end()  # the front end's tick: one Wrote (shared positions: nothing)
            if not positions_in_shared:
                core.control.poll(1000)  # (waits off the CPU for the I/O threads)
            c0 = time.thread_time()
            core.iterate_once()  # take the Wrote (or read the positions), copy the samples out, send the read ends
            c1 = time.thread_time()
            if not positions_in_shared:  # shared: the read ends are in shared memory, no message
                results.poll(1000)
                client._apply_read(m.results_decoder.decode(results.recv()))
            if r:  # the first round warms up
                cpu += time.process_time() - t0
                core_cpu += c1 - c0
        return cpu / (rounds * per_tick), core_cpu / (rounds * per_tick)
    finally:
        results.close(0)
        client._control.close(0)
        core.close()
        fe_ctx.term()
        core_ctx.term()
        shared.close()


def _cost_plain_stores(num_streams: int, per_tick: int, rounds: int, packet: np.ndarray) -> tuple[float, float]:
    """(CPU s per packet, of which the core's side) with the rings as they were: positions as plain stores in shared memory
    (the front end: samples, arrival, then write_pos; the core: every slot's positions compared,
    the moved ones copied out, read_pos stored). Kept here only as the baseline."""
    from multiprocessing import shared_memory

    n, size = num_streams, 4 * len(packet)
    shm = shared_memory.SharedMemory(create=True, size=n * (size * 4 + 24))
    try:
        ring = np.ndarray((n, size), np.float32, shm.buf)
        write_pos, read_pos = (np.ndarray(n, np.int64, shm.buf, n * size * 4 + 8 * n * i) for i in (0, 1))
        arrival = np.ndarray(n, np.float64, shm.buf, n * size * 4 + 16 * n)
        write_pos[:], read_pos[:] = 0, 0
        engine = SequenceEngine(n, check=False)
        streams = [engine.admit(stream_id=f"cost-{i}", slot=i) for i in range(n)]
        active = np.ones(n, bool)

        def write(slot: int, samples: np.ndarray, now: float) -> None:
            w = int(write_pos[slot])
            i = w % size
            first = min(len(samples), size - i)
            ring[slot, i : i + first] = samples[:first]
            if first < len(samples):
                ring[slot, : len(samples) - first] = samples[first:]
            arrival[slot] = now
            write_pos[slot] = w + len(samples)

        def take_audio() -> None:
            slots = np.flatnonzero(active)
            ends = write_pos[slots]
            moved = ends != read_pos[slots]
            for slot, end, arrived in zip(slots[moved].tolist(), ends[moved].tolist(), arrival[slots[moved]].tolist()):
                r = int(read_pos[slot])
                i, j = r % size, end % size
                parts = (ring[slot, i:j],) if i < j or end == r else (ring[slot, i:], ring[slot, :j])
                engine.take_audio(streams[slot], parts, arrived)
                read_pos[slot] = end

        cpu = core_cpu = 0.0
        for r in range(rounds + 1):
            t0 = time.process_time()
            for k in range(r * per_tick, (r + 1) * per_tick):
                slot = k % n
                if size - int(write_pos[slot] - read_pos[slot]) >= len(packet):  # the client's space check
                    write(slot, packet, time.time())
            c0 = time.thread_time()
            take_audio()
            c1 = time.thread_time()
            if r:
                cpu += time.process_time() - t0
                core_cpu += c1 - c0
        return cpu / (rounds * per_tick), core_cpu / (rounds * per_tick)
    finally:
        del ring, write_pos, read_pos, arrival
        shm.close()
        shm.unlink()


def cost(num_streams: int, per_tick: int, packets: int, repeats: int = 3) -> dict:
    """Both protocols, alternated `repeats` times in this process; the median of each."""
    packet = np.zeros(1600, np.float32)  # 100 ms at 16 kHz
    rounds = max(1, packets // per_tick)
    runs: dict[str, list[tuple[float, float]]] = {"plain_stores": [], "messages": [], "shared": []}
    for _ in range(repeats):
        runs["plain_stores"].append(_cost_plain_stores(num_streams, per_tick, rounds, packet))
        for name in ("messages", "shared"):
            with tempfile.TemporaryDirectory(prefix="ring-cost-") as ipc_dir:
                runs[name].append(_cost_messages(num_streams, per_tick, rounds, packet, ipc_dir, name == "shared"))
    e = {"streams": num_streams, "per_tick": per_tick, "packet_samples": len(packet), "packets": rounds * per_tick}
    for name, v in runs.items():
        e[f"{name}_us_per_packet"] = round(1e6 * float(np.median([x[0] for x in v])), 2)
        e[f"{name}_core_us_per_packet"] = round(1e6 * float(np.median([x[1] for x in v])), 2)
    e["runs_us_per_packet"] = {k: [round(1e6 * x[0], 2) for x in v] for k, v in runs.items()}
    return e


def main() -> None:
    from benchmarks.common import run_record, write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--per-tick", default="1,16,256", help="packets written between two core iterations")
    p.add_argument("--packets", type=int, default=20000, help="per measurement")
    p.add_argument("--stress-streams", type=int, default=48, help="streams through the stress check (0: skip it)")
    p.add_argument("--stress-positions", choices=("messages", "shared"), default="messages",
                   help="where the stress check's ring positions live")
    p.add_argument("--notes", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    record = run_record()
    record["notes"] = args.notes
    record["machine"] = os.uname().machine
    out = {"run": record, "cost": []}
    for per_tick in [int(x) for x in args.per_tick.split(",")]:
        e = cost(args.streams, per_tick, args.packets)
        out["cost"].append(e)
        print(f"{e['streams']} streams, {per_tick:4d} packets per tick, us per packet (core's share):"
              f"  plain stores {e['plain_stores_us_per_packet']:6.2f} ({e['plain_stores_core_us_per_packet']:5.2f})"
              f"  messages {e['messages_us_per_packet']:6.2f} ({e['messages_core_us_per_packet']:5.2f})"
              f"  shared {e['shared_us_per_packet']:6.2f} ({e['shared_core_us_per_packet']:5.2f})", flush=True)
    if args.stress_streams:
        out["stress"] = stress(num_streams=args.stress_streams, positions_in_shared=args.stress_positions == "shared")
        s = out["stress"]
        print(f"stress on {record['machine']}: {s['streams']} streams, {s['packets']} packets, {s['samples']} samples checked,"
              f" {len(s['bad'])} bad, {s['seconds']} s", flush=True)
    if args.out:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
