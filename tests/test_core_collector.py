"""The engine core process tunes the cyclic collector for serving (core_proc.py
tune_collector_for_serving; issue 46: the collector's passes were up to 40% of the core's host time
per stream-step): its start-up heap left out, young passes run less often."""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest

from nemo_serve.core import core_proc


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


@pytest.fixture
def tuned():
    thresholds = gc.get_threshold()
    gc.collect()
    try:
        yield core_proc.tune_collector_for_serving
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_the_startup_heap_is_left_out_and_later_cycles_are_still_collected(tuned):
    before = [object.__new__(_Node)]  # a live object of the start-up heap
    tuned()
    assert gc.get_freeze_count() > 0
    assert not any(o is before for o in gc.get_objects())  # no pass walks it any more
    later = _Node()
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None  # streams' garbage made after start-up is collected as before


def test_cyclic_garbage_left_before_the_freeze_is_collected_not_frozen(tuned):
    """The docstring's "gc.collect() runs first so there is none": a cycle already unreachable when
    the core tunes is freed then; frozen, no later pass (not even gc.collect()) would ever free it."""
    cycle = _Node()
    gone = weakref.ref(cycle)
    del cycle  # unreachable, not yet collected: the fixture's gc.collect() ran before it was made
    assert gone() is not None
    tuned()
    gc.collect()
    assert gone() is None


def test_a_steps_worth_of_small_lists_runs_no_young_pass(tuned):
    tuned()
    passes = gc.get_stats()[0]["collections"]
    kept = [[i] for i in range(5_000)]  # about what a 2,000-row step allocates (Python's default passes every 700)
    assert gc.get_stats()[0]["collections"] == passes, len(kept)


def test_the_core_process_tunes_after_loading_and_before_serving():
    source = inspect.getsource(core_proc.run_core_process)
    assert source.index("load_engine(settings)") < source.index("tune_collector_for_serving()") < source.index("proc.run(")
