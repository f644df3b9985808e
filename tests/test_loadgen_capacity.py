"""benchmarks/loadgen_capacity.py's blast mode (issue 48 item 4): the verdict that says whether a
level of the load generator against the stub counts (the generator's own lateness, per process,
and the stub kept up), and one small level end to end: blast at 80 ms packets from two processes
against the picows stub, a partial per packet."""

import multiprocessing as mp
import time
from types import SimpleNamespace

import pytest

from benchmarks import loadgen_stub
from benchmarks.load_items import make_items
from benchmarks.load_workers import judge
from benchmarks.loadgen_capacity import _measure_blast, loadgen_verdict
from benchmarks.server_process import free_port


def _level(worker_p99_ms: list[float], *, partial_p95_ms: float = 5.0, completed: int = 4, short_sends: int = 0) -> dict:
    workers = [{"worker": w, "packets": 100, "send_lateness_ms": {"p50": 1.0, "p99": p99, "max": p99}}
               for w, p99 in enumerate(worker_p99_ms)]  # fmt: skip
    level = {"workers": workers, "streams": 4, "items_completed": completed, "errors": {},
             "partial_latency_ms": {"p95": partial_p95_ms}, "drift_ms_per_s": {"p90": 1.0},
             "sender": [{"short_sends": short_sends} for _ in workers],
             "send_lateness_ms": {"p99": 9.0}}  # all packets merged: one late process of two can hide under the bound  # fmt: skip
    judge(level, 80.0, 20.0, 10.0)
    return level


def test_a_level_counts_only_if_every_sender_process_kept_its_schedule_and_the_stub_kept_up():
    assert loadgen_verdict(_level([2.0, 9.9]), 0.5, 80.0) == {"valid": True, "stub_kept_up": True, "sustained": True}
    # one late process of two makes the level invalid, whatever the other and the merged p99 say
    late = loadgen_verdict(_level([2.0, 10.5]), 0.5, 80.0)
    assert late == {"valid": False, "stub_kept_up": True, "sustained": False}
    # the stub as the limit: its core full, bytes it did not take, or its partials late
    assert loadgen_verdict(_level([2.0]), 0.95, 80.0)["stub_kept_up"] is False
    assert loadgen_verdict(_level([2.0], short_sends=1), 0.5, 80.0)["stub_kept_up"] is False
    assert loadgen_verdict(_level([2.0], partial_p95_ms=161.0), 0.5, 80.0)["stub_kept_up"] is False
    # a stream that did not complete: valid and kept up may hold, sustained does not
    assert loadgen_verdict(_level([2.0], completed=3), 0.5, 80.0)["sustained"] is False


@pytest.fixture
def picows_stub():
    pytest.importorskip("picows")
    port = free_port()
    procs = [mp.get_context("fork").Process(target=loadgen_stub.serve, args=("picows", port, 80.0), daemon=True)
             for _ in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    time.sleep(0.5)
    yield port, [p.pid for p in procs]
    for p in procs:
        p.terminate()
        p.join()


def test_blast_at_80_ms_packets_from_two_processes_gets_a_partial_per_packet(picows_stub):
    port, pids = picows_stub
    items = make_items("synth", 2, (1.5, 1.6))
    args = SimpleNamespace(chunk_ms=80.0, duration=1.2, sender_fifo=False, max_send_lateness_ms=10.0)
    t = time.time()
    row = _measure_blast(port, items, 6, 2, "blast", args, pids)
    assert time.time() - t < 10  # the stub's `done` seen as it came (blast's tail waits 30 s for it otherwise)
    assert row["packets"] == 6 * 15 and [w["packets"] for w in row["workers"]] == [45, 45]
    assert row["items_completed"] == 6 and not row["errors"]
    assert sum(x["short_sends"] for x in row["sender"]) == 0
    assert row["stub_cpu_s"] >= 0 and 0 <= row["stub_busy"] < 1
