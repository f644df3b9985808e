"""Speakers on /v1/realtime, in the shape OpenAI's realtime transcription uses for them.

OpenAI asks for speakers by naming its diarizing transcription model, `gpt-4o-transcribe-diarize`,
in the session's transcription settings; each item's speakers then come as
`conversation.item.input_audio_transcription.segment` events (the SDK's
ConversationItemInputAudioTranscriptionSegment: id, item_id, content_index, speaker, start, end,
text), before the item's `completed`, which has no speaker field. Here the same name opens each
item's engine stream with all the diarizer's speakers (engine/speakers.py); the segments are the
file API's diarized_json segments (transcript_formats.py): one per run of one speaker's words,
speaker "A" for the diarizer's speaker 0, times on the item's own clock (as its words'). A server
without --diarizer refuses the name at session.update, before any audio.
"""

from __future__ import annotations

from ..engine.results import StreamResult
from .realtime_protocol import RealtimeError, ServerEvent, event
from .transcript_formats import diarized_segments

DIARIZING_MODEL = "gpt-4o-transcribe-diarize"
SEGMENT = "conversation.item.input_audio_transcription.segment"


def check_diarizing(model_name: str | None, num_speakers: int | None, event_id: str | None) -> None:
    """RealtimeError when the session asks for speakers from a server without a diarizer."""
    if model_name == DIARIZING_MODEL and num_speakers is None:
        raise RealtimeError(f"transcription model {DIARIZING_MODEL}: this server has no diarizer loaded "
                            "(start it with --diarizer)", code="model_not_found", param="transcription.model",
                            event_id=event_id)  # fmt: skip


def diarization_option(model_name: str | None, num_speakers: int | None) -> dict:
    """open_stream's keyword for an item of a session that named the diarizing model: {} otherwise."""
    if model_name != DIARIZING_MODEL or num_speakers is None:
        return {}
    return {"diarization": {"max_speakers": num_speakers}}


def segment_events(r: StreamResult, item_id: str) -> list[ServerEvent]:
    """A diarized item's final -> its speaker segments (none for a plain stream's)."""
    if r.word_speakers is None:
        return []
    return [event(SEGMENT, item_id=item_id, content_index=0, **{k: v for k, v in s.items() if k != "type"})
            for s in diarized_segments([r])]  # fmt: skip
