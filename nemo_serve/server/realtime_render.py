"""/v1/realtime's send side: engine results -> the dialect's JSON events, one renderer per dialect.

  OpenAIRenderer   OpenAI's Realtime transcription events (GA and beta name only the session
                   events differently: realtime.py's `_session_event`)
  NimRenderer      NVIDIA NIM's: the same events, and a last item that ended in silence repeats
                   the last utterance (nim_items.LastUtterance)

Per result (its `segment` is the session's, realtime_items.SegmentKeys): the delta (text not
sent yet; with turn detection and no speech detector, speech_started before the first), then
for a final: speech_stopped and committed where the endpointer ended the item, a diarized
item's speaker segments, completed; after the session's last item's `done`, close 1000.
The item names (`item_id`, chained by `previous_item_id`) are kept here, for the receive side's
events too (commit, the speech detector: a turn's id, announced at its onset, is taken by the
segment that holds the speech when the segment is first named, realtime_items.Turn; a turn no
segment holds is committed and completed empty, so every id announced comes). Owner: the event loop; `render` runs in the send task.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..engine.results import StreamResult
from .nim_items import LastUtterance
from .realtime_items import ItemStream, Turn, claim_turn, ended_turns
from .realtime_protocol import DeltaEvent, ServerEvent, completed_event, delta_event, event, new_id
from .realtime_speakers import segment_events
from .wire import Rendered


class ItemManager(Protocol):
    """What a renderer reads of realtime.RealtimeFormat (a Protocol, so that the two modules do not
    import each other)."""

    keys: Any  # realtime_items.SegmentKeys
    num_items: int
    num_items_sent: int
    session: Any  # stream_session.StreamSession
    vad: Any
    rt: Any  # realtime_protocol's session settings
    ctx: Any  # context.ServerContext

TRANSCRIPTION = "conversation.item.input_audio_transcription"
DELTA = f"{TRANSCRIPTION}.delta"


class OpenAIRenderer:
    def __init__(self, items: ItemManager) -> None:
        self.items = items
        self.segment_to_item: dict[int, str] = {}  # session segment -> item_id
        self.last_item_id: str | None = None  # the previous completed or committed item
        self.sent_text: dict[int, str] = {}  # what the deltas of each open segment carried
        self.speaking: set[int] = set()  # segments speech_started was sent for
        self.committed: set[int] = set()  # segments a committed event announced
        self.cleared: set[int] = set()  # segments whose completion is not sent
        self.num_completed = 0  # completed events sent: the next one's nemo_serve.segment (no gaps)

    def item_id(self, segment: int) -> str:
        """A named segment's item_id (_name named it)."""
        return self.segment_to_item[segment]

    def announce(self, item: ItemStream, onset_s: float) -> Turn:
        """The detector heard speech begin in `item`'s audio: the id speech_started names, that of
        the item that will hold it (a segment claims it when named, else it completes empty)."""
        turn = Turn(new_id("item"), onset_s)
        item.turns.append(turn)
        return turn

    def _name(self, segment: int, item: ItemStream, first_token_s: float | None) -> list[ServerEvent]:
        """Name `segment` (once): the id of the turn it holds, else a new one; the orphans before
        that turn are committed and completed empty first (their events returned)."""
        if segment in self.segment_to_item:
            return []
        turn, orphans = claim_turn(item, first_token_s)
        self.segment_to_item[segment] = turn.item_id if turn is not None else new_id("item")
        return self._orphan_events(orphans, item)

    def committed_event(self, segment: int, item: ItemStream | None = None) -> ServerEvent:
        """input_audio_buffer.committed for `segment`'s item, chained to the item before it (a
        commit names the segment: the first turn of its stream not yet claimed)."""
        if item is not None:  # the receive side's commit: it claims its stream's first unclaimed turn, no orphan
            self._name(segment, item, None)
        item_id = self.item_id(segment)
        previous, self.last_item_id = self.last_item_id, item_id
        self.committed.add(segment)
        return event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)

    def _orphan_events(self, turns: list[Turn], item: ItemStream) -> list[ServerEvent]:
        """An item for each turn no segment holds: committed, and completed with nothing in it (its
        span is the turn's; tokens stay /ws's: the model decoded nothing there, or put the words
        in another item)."""
        events: list[ServerEvent] = []
        for t in turns:
            previous, self.last_item_id = self.last_item_id, t.item_id
            events.append(event("input_audio_buffer.committed", item_id=t.item_id, previous_item_id=previous))
            empty = _empty_result(t.onset_s - item.start_s, (t.stop_s if t.stop_s is not None else t.onset_s) - item.start_s)
            completed = completed_event(empty, t.item_id, self.items.ctx.model.vocabulary, item.start_s, False, self.num_completed)
            self.num_completed += 1
            self.completing(completed, t.item_id, False)
            events.append(completed)
        return events

    # ------------------------------------------------------------------ the send task
    def render(self, r: StreamResult) -> Rendered:
        items = self.items
        item = items.keys.key_to_stream[r.segment]
        events = self._text_events(r, item)
        if r.is_final:
            events += self._final_events(r, item)
        frames = [e.model_dump_json() for e in events]
        if not r.done:
            return Rendered(frames)
        items.keys.forget(item)
        items.num_items_sent += 1
        session = items.session
        if not session.input_ended or items.num_items_sent < items.num_items:
            return Rendered(frames)
        return Rendered(frames, close=end_reason_text(session.end_reason or "end"))

    def _text_events(self, r: StreamResult, item: ItemStream) -> list[ServerEvent | DeltaEvent]:
        """The delta, and before the item's first one speech_started (turn detection on, no detector)."""
        sent = self.sent_text.get(r.segment, "")
        if r.segment in self.cleared or not r.text.startswith(sent) or len(r.text) <= len(sent):
            return []
        items = self.items
        events: list[ServerEvent | DeltaEvent] = self._name(r.segment, item, _first_token_s(r, item))
        item_id = self.item_id(r.segment)
        if items.vad is None and items.rt.turn_detection is not None and r.segment not in self.speaking and r.token_times_s:
            self.speaking.add(r.segment)
            events.append(event("input_audio_buffer.speech_started", item_id=item_id,
                                audio_start_ms=self._speech_start_ms(item, r)))  # fmt: skip
        events.append(delta_event(DELTA, item_id, r.text[len(sent):]))
        self.sent_text[r.segment] = r.text
        return events

    def _speech_start_ms(self, item: ItemStream, r: StreamResult) -> int:
        """The item's first token, moved back by prefix_padding_ms (not before the item's start),
        on the session's audio clock."""
        td = self.items.rt.turn_detection
        pad_s = (td.prefix_padding_ms or 0) / 1000 if td is not None else 0.0
        return int(round((item.start_s + max(r.segment_start_s, r.token_times_s[0] - pad_s)) * 1000))

    def _final_events(self, r: StreamResult, item: ItemStream) -> list[ServerEvent]:
        items = self.items
        announced = r.segment in self.committed
        self.sent_text.pop(r.segment, None)
        self.speaking.discard(r.segment)
        last = r.done and item.last
        # Turns that ended within this segment and that it does not hold can be held by no later one.
        turns_end_s = None if r.done else item.start_s + r.audio_processed_s
        if r.segment in self.cleared or not (r.text or announced or last):
            # silence the endpointer closed, an item the client cleared, audio that stopped in silence
            return [] if r.segment in self.cleared else self._orphan_events(ended_turns(item, turns_end_s), item)
        events = self._name(r.segment, item, _first_token_s(r, item))
        item_id = self.item_id(r.segment)
        orphans = ended_turns(item, turns_end_s)
        if last:  # is_last_result stays the session's last event
            events += self._orphan_events(orphans, item)
            orphans = []
        if not announced:  # the endpointer ended it, or the audio stopped: what server VAD says
            if items.vad is None and items.rt.turn_detection is not None and not last:
                end_s = r.eou_time_s if r.eou_time_s is not None else r.audio_processed_s  # an EOU: its audio time
                ms = int(round((item.start_s + end_s) * 1000))
                events.append(event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms))
            events.append(self.committed_event(r.segment))
        completed = completed_event(r, item_id, items.ctx.model.vocabulary, item.start_s, last, self.num_completed)
        self.num_completed += 1
        self.completing(completed, item_id, last)
        events += segment_events(r, item_id)  # a diarized item's speakers, before its completed
        events.append(completed)
        return events + self._orphan_events(orphans, item)

    def completing(self, completed: ServerEvent, item_id: str, last: bool) -> None:
        """An item's `completed` event, before it is sent: the dialect's last word on it."""


class NimRenderer(OpenAIRenderer):
    """A NIM client's session (its update had `input_audio_params`)."""

    def __init__(self, items: ItemManager) -> None:
        super().__init__(items)
        self.said = LastUtterance()  # what a final repeats after trailing silence

    def completing(self, completed: ServerEvent, item_id: str, last: bool) -> None:
        self.said.on_completed(completed, item_id, last)


def _first_token_s(r: StreamResult, item: ItemStream) -> float | None:
    """The time of the segment's first token on the session's clock (None: no token yet)."""
    return item.start_s + r.token_times_s[0] if r.token_times_s else None


def _empty_result(start_s: float, end_s: float) -> StreamResult:
    """An orphan turn's item (times from its engine stream's start): nothing decoded in it."""
    return StreamResult(stream_id="", text="", segment=-1, is_final=True, new_token_ids=[], token_ids=[],
                        token_times_s=[], segment_start_s=max(0.0, start_s), audio_processed_s=max(0.0, end_s),
                        audio_arrival_time=0.0, end_reason="silence")  # fmt: skip


def end_reason_text(reason: str) -> str:
    """The close reason for a session whose input ended with `reason`."""
    return {"end": "end of input", "draining": "server is draining (shutting down)",
            "max_stream_duration": "maximum stream duration reached"}.get(reason, reason)  # fmt: skip
