"""Python's cyclic collector tuned for a serving process: the engine core (core/core_proc.py) and
each front-end process (server/runner.py). No torch, no NeMo: front ends import it too.

Both processes build a large heap before they serve (the core: torch, NeMo, the model; a front
end: FastAPI, pydantic, uvicorn, grpc.aio, picows, about 80,000 tracked objects) and then
allocate per step or per packet. With Python's defaults those allocations run a young pass every
700 containers and, now and then, an oldest-generation pass over the whole start-up heap again:
a third of the core's host time per stream-step at 16,000 streams
(host_profile_ab_issue46_gc_cpu.json); in a front end at 256 paced 20 ms streams, about 1 µs of
a packet's CPU and oldest passes of 39-90 ms of CPU each, the event loop stopped for every stream
meanwhile (frontend_gc_256_cpu.json). At 32 streams it was a few tenths of a µs per packet.
"""

from __future__ import annotations

import gc

# Container allocations between young-generation passes while serving (Python's default: 700).
# A core step allocates a few lists per stepped stream, so the default ran a pass every few hundred
# rows and, every hundred passes, one over the streams' long-lived objects. The garbage that waits
# longer is at most this many young objects.
GC_YOUNG_THRESHOLD = 20_000


def tune_collector_for_serving() -> None:
    """Leave the heap built before serving (objects that live as long as the process) out of the
    cyclic collector's passes, as vLLM's engine core does after start-up, and run the
    young-generation pass less often (GC_YOUNG_THRESHOLD). Objects made later (streams,
    connections, updates) are still collected; only cyclic garbage already there at the freeze
    would stay, and gc.collect() runs first so there is none."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
