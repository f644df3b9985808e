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

The stress check (`--stress-streams`) is benchmarks/ring_stress.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.ring_stress import stress  # noqa: E402
from benchmarks.sequence_engine import SequenceEngine, model_info  # noqa: E402


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
