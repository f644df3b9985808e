"""A stream aborted while the one-process engine's loop is taking in new streams gives its slot back."""

from __future__ import annotations

import queue

import pytest

from . import helpers
from .helpers_server import TEST_MODEL


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


def test_abort_that_races_admission_frees_the_slot(tiny):
    """A stream opened and aborted by a network thread while the loop is between taking in new
    streams and applying requests: the abort must still end it once it has its slot (it held the
    slot forever: the request was consumed while the stream was still pending)."""
    eng = helpers.new_engine(tiny, num_slots=2)
    inbox, raced = eng._inbox, []

    class OpenAndAbortAfterTheInboxIsTaken:
        def put(self, item):
            inbox.put(item)

        def get_nowait(self):
            try:
                return inbox.get_nowait()
            except queue.Empty:
                if not raced:  # the network thread runs here, once
                    raced.append(eng.open_stream(lambda update: None, updates=True))
                    eng.abort(raced[0], "client gone")
                raise

    eng._inbox = OpenAndAbortAfterTheInboxIsTaken()
    for _ in range(3):
        eng.iterate()
    assert raced and eng.num_open_streams == 0 and eng.num_free_slots == 2
    helpers.assert_engine_empty(eng)
