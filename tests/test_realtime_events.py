"""/v1/realtime's cheap server events (issue 48): the delta rendered without pydantic must be the
same JSON as the pydantic event's; event ids keep new_id's shape, stay unique and differ across a
fork; an item's id is made once per segment."""

import json
import os
import re

import pytest

from nemo_serve.server import realtime_render
from nemo_serve.server.realtime_protocol import DeltaEvent, event, new_event_id
from nemo_serve.server.realtime_render import DELTA, OpenAIRenderer

TEXTS = ["", " hello", 'quote " and backslash \\', "tab\tnew\nline\r\x00\x1f", "é ü 中文 😀", "\u2028\u2029</script>",
         "a" * 5000]  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_delta_is_the_pydantic_events_json_byte_for_byte(text):
    fast = DeltaEvent(DELTA, "event_0123456789abcdef0123", "item_x", 0, text).model_dump_json()
    slow = event(DELTA, event_id="event_0123456789abcdef0123", item_id="item_x", content_index=0, delta=text)
    assert fast == slow.model_dump_json()
    assert json.loads(fast)["delta"] == text


def test_event_ids_have_new_ids_shape_and_are_unique():
    ids = [new_event_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"event_[0-9a-f]{20}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert event("x").event_id != event("x").event_id


def test_a_forked_front_end_gets_its_own_event_id_prefix():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then out without running pytest's exit handlers
        os.write(write, new_event_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child[:18] != new_event_id()[:18]  # "event_" + the 12-digit prefix


def test_item_id_is_made_once_per_segment(monkeypatch):
    made = []
    monkeypatch.setattr(realtime_render, "new_id", lambda prefix: made.append(prefix) or f"{prefix}_{len(made)}")
    r = OpenAIRenderer(items=None)
    assert r.item_id(3) == r.item_id(3) == "item_1"
    assert r.item_id(4) == "item_2"
    assert made == ["item", "item"]
