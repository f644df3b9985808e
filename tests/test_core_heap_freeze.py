"""The engine core process leaves its start-up heap out of the cyclic collector (core_proc.py
freeze_startup_heap; issue 46: the collector's passes over that heap were 40% of the core's host
time per stream-step)."""

from __future__ import annotations

import gc
import inspect
import weakref

from nemo_serve.core import core_proc


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_the_startup_heap_is_left_out_and_later_cycles_are_still_collected():
    before = [object.__new__(_Node)]  # a live object of the start-up heap
    gc.collect()
    try:
        core_proc.freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # no pass walks it any more
        later = _Node()
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None  # streams' garbage made after start-up is collected as before
    finally:
        gc.unfreeze()


def test_the_core_process_freezes_after_loading_and_before_serving():
    source = inspect.getsource(core_proc.run_core_process)
    assert source.index("load_engine(settings)") < source.index("freeze_startup_heap()") < source.index("proc.run(")
