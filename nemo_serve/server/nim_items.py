"""Where a NIM session's items end (issue 45, defect 11).

NVIDIA's realtime client (nvidia-riva-client's `RealtimeClientASR`, driven by its
`scripts/asr/realtime_asr_client.py`) appends 100 ms at a time and commits after every append, as
a flush; it keeps the transcript of the last `completed` it reads as its final, prints it when
that event says `is_last_result`, saves it, and stops reading there (or at any error event). So in
a session created through NIM's bootstrap (its update carries `input_audio_params`), a commit
neither ends the item nor is answered: the session keeps one engine stream and items end where
the speech ends: the endpointer (the session's turn_detection), an append's
`runtime_config.force_eou` (the client's `request_force_eou`: the engine ends the segment after
the whole chunks appended before it, a positional force_final, engine/forced_ends.py, so timing
never moves it), or the end of input; the last
item is then the whole last utterance (or, after trailing silence, repeats it: LastUtterance).
Rejected: ending an item at each commit the model had
caught up with (what we did): items split where timing put them, mid-word, and the client showed
only the last piece.

Owner: the event loop (realtime.RealtimeFormat).
"""

from __future__ import annotations

from dataclasses import dataclass


def wants_force_eou(runtime_config: object) -> bool:
    """`runtime_config.force_eou` of an append, as NIM's client sends it (the string "true")."""
    if not isinstance(runtime_config, dict):
        return False
    value = runtime_config.get("force_eou")
    return value is True or (isinstance(value, str) and value.lower() == "true")


@dataclass
class LastUtterance:
    """The last item with text a NIM session sent. When speech ends, the endpointer closes the
    utterance; audio that goes on in silence until the end of input leaves an empty last item,
    and NVIDIA's client would print an empty `Final Transcript` and save nothing. So that last
    event's `transcript` repeats the last utterance's and `nemo_serve.repeats_item` names its
    item; its tokens are not repeated (`nemo_serve.token_ids` stays empty: tokens summed over
    items stay /ws's). Rejected: holding each endpointed item back until the next has text or
    the input ends, which delays every live final by the length of the next pause."""

    text: str = ""
    item_id: str | None = None

    def on_completed(self, ev, item_id: str, last: bool) -> None:
        """A NIM session's `completed` event, before it is sent (patched when it is an empty last)."""
        if ev.transcript:
            self.text, self.item_id = ev.transcript, item_id
        elif last and self.item_id is not None:
            ev.transcript = self.text
            ev.nemo_serve["repeats_item"] = self.item_id
