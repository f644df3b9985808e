"""/v1/realtime's cheap server events (issue 48): the delta rendered without pydantic must be the
same JSON as the pydantic event's; event ids keep new_id's shape, stay unique and differ across a
fork; an item's id is made once per segment."""

import json
import os
import re

import pytest

from nemo_serve.server import realtime_render
from nemo_serve.server.realtime_protocol import DeltaEvent, event, new_event_id
from nemo_serve.server.realtime_items import ItemStream
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
    item = ItemStream(0, decoder=None)  # no speech detector turns: each segment gets a new id
    assert r._name(3, item, None) == r._name(3, item, 0.5) == []
    assert r.item_id(3) == r.item_id(3) == "item_1"
    r._name(4, item, 0.5)
    assert r.item_id(4) == "item_2"
    assert made == ["item", "item"]


def test_every_turn_the_detector_announced_is_committed_and_completed():
    """The detector's turns (speech_started's ids) against the engine's segments, rendered: a
    cough in a silence segment the endpointer closed empty gets an empty item of its own (OpenAI
    commits every turn its VAD ends), the speech's segment takes its own turn's id (not the
    cough's, which began earlier), and a second turn whose words the endpointer kept in the same
    segment completes empty after it. No id is announced that is not committed and completed."""
    from types import SimpleNamespace

    from nemo_serve.engine.results import StreamResult

    items = SimpleNamespace(vad=object(), rt=SimpleNamespace(turn_detection=object()),
                            ctx=SimpleNamespace(model=SimpleNamespace(vocabulary=["a", "b"])))  # fmt: skip
    r, item = OpenAIRenderer(items), ItemStream(0, decoder=None)
    cough, speech = r.announce(item, 1.0), None
    cough.stop_s = 1.2

    def result(segment, text, times, start, end, final):
        return StreamResult("s", text, segment, final, [], [1] * len(times), times, start, end, 0.0,
                            end_reason="silence" if final else None)  # fmt: skip

    def said(events):
        return [(e.type.rsplit(".", 1)[-1], e.item_id, getattr(e, "transcript", None)) for e in events if e.type != DELTA]

    speech = r.announce(item, 3.0)  # the receive side is ahead: both announced before any result
    assert said(r._final_events(result(0, "", [], 0.0, 2.5, True), item)) == [
        ("committed", cough.item_id, None), ("completed", cough.item_id, "")]  # fmt: skip
    deltas = r._text_events(result(1, "b", [3.1], 2.5, 3.5, False), item)
    assert [e.item_id for e in deltas] == [speech.item_id]
    speech.stop_s = 3.4
    second = r.announce(item, 3.6)
    second.stop_s = 4.0
    events = r._final_events(result(1, "b b", [3.1, 3.7], 2.5, 4.8, True), item)
    assert said(events) == [("committed", speech.item_id, None), ("completed", speech.item_id, "b b"),
                            ("committed", second.item_id, None), ("completed", second.item_id, "")]  # fmt: skip
    assert [e.previous_item_id for e in events if e.type.endswith("committed")] == [cough.item_id, speech.item_id]
