"""A front-end process tunes the cyclic collector once it serves (nemo_serve/collector.py, called
at the end of server/runner.py DrainingServer.startup; issue 48: at 256 paced streams each
oldest pass over the front end's start-up heap took 39-90 ms of CPU, frontend_gc_256_cpu.json), and garbage made while
serving is still collected: memory stays bounded."""

from __future__ import annotations

import gc
import weakref

import pytest

from nemo_serve.collector import GC_YOUNG_THRESHOLD

from .helpers_draining_server import draining_server


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


@pytest.fixture
def serving():
    """A DrainingServer serving in a thread of this process (the collector is per process)."""
    with draining_server() as server:
        yield server


def test_a_serving_front_end_leaves_its_startup_heap_out_and_passes_less_often(serving):
    assert gc.get_freeze_count() > 10_000  # this process's imports: uvicorn, FastAPI's app modules, ...
    assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD


def test_a_cycle_made_while_serving_is_collected_without_being_asked(serving):
    passes = gc.get_stats()[0]["collections"]
    cycle = _Node()
    gone = weakref.ref(cycle)
    del cycle
    churn = [[i] for i in range(GC_YOUNG_THRESHOLD + 1_000)]  # one young pass's worth of containers
    del churn
    assert gc.get_stats()[0]["collections"] > passes  # the pass ran on its own: no gc.collect() here
    assert gone() is None
