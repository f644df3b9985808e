"""Speakers on /v1/realtime, in the shape OpenAI's realtime transcription uses for them.

OpenAI asks for speakers by naming its diarizing transcription model, `gpt-4o-transcribe-diarize`,
in the session's transcription settings; each item's speakers then come as
`conversation.item.input_audio_transcription.segment` events (the SDK's
ConversationItemInputAudioTranscriptionSegment: id, item_id, content_index, speaker, start, end,
text), before the item's `completed`, which has no speaker field. Here the same name opens each
item's engine stream with all the diarizer's speakers, or max_speakers (engine/speakers.py); the segments are the
file API's diarized_json segments (transcript_formats.py): one per run of one speaker's words,
speaker "A" for the diarizer's speaker 0, times on the item's own clock (as its words'). A server
without --diarizer refuses the name at session.update, before any audio.

With that model the transcription settings may also hold /ws's two diarization options,
`max_speakers` (1..the diarizer's speakers) and `split_on_speaker_change` (a speaker change ends
the engine segment, so the item: each item then holds one speaker); checked at the update by the
engine's own rule (engine/speakers.check_diarization), refused with any other model.
"""

from __future__ import annotations

from ..engine.results import StreamResult
from ..engine.speakers import check_diarization
from .realtime_protocol import DIARIZING_MODEL, RealtimeConfig, RealtimeError, ServerEvent, Transcription, event
from .transcript_formats import diarized_segments

SPEAKER_FIELDS = ("max_speakers", "split_on_speaker_change")
SEGMENT = "conversation.item.input_audio_transcription.segment"


def check_diarizing(model_name: str | None, num_speakers: int | None, event_id: str | None) -> None:
    """RealtimeError when the session asks for speakers from a server without a diarizer."""
    if model_name == DIARIZING_MODEL and num_speakers is None:
        raise RealtimeError(f"transcription model {DIARIZING_MODEL}: this server has no diarizer loaded "
                            "(start it with --diarizer)", code="model_not_found", param="transcription.model",
                            event_id=event_id)  # fmt: skip


def transcription_diarization(t: Transcription, model_name: str | None, num_speakers: int | None,
                              event_id: str | None) -> dict:  # fmt: skip
    """The update's speaker options that it names, checked ({} if none), or RealtimeError:
    without a diarizer, with a model (`model_name`: the session's after this update) other than
    the diarizing one, or a value /ws's `diarization` option would refuse."""
    named = {k: getattr(t, k) for k in SPEAKER_FIELDS if getattr(t, k) is not None}
    for key, value in named.items():
        param = f"transcription.{key}"
        if num_speakers is None:
            raise RealtimeError(f"{param}: this server has no diarizer loaded (start it with --diarizer)",
                                param=param, event_id=event_id)  # fmt: skip
        if model_name != DIARIZING_MODEL:
            raise RealtimeError(f"{param} needs transcription model {DIARIZING_MODEL} (other models give no speakers)",
                                param=param, event_id=event_id)  # fmt: skip
        try:  # one field at a time, so that the error names the one that is wrong
            check_diarization({key: value}, num_speakers)
        except ValueError as e:  # its words name /ws's `diarization.`; here the field is transcription's
            raise RealtimeError(str(e).replace("diarization.", "transcription.", 1), param=param,
                                event_id=event_id) from None  # fmt: skip
    return named


def diarization_option(rt: RealtimeConfig, num_speakers: int | None) -> dict:
    """open_stream's keyword for an item of a session that named the diarizing model: {} otherwise."""
    if rt.transcription_model != DIARIZING_MODEL or num_speakers is None:
        return {}
    return {"diarization": {"max_speakers": rt.max_speakers or num_speakers,
                            "split_on_speaker_change": rt.split_on_speaker_change}}  # fmt: skip


def segment_events(r: StreamResult, item_id: str) -> list[ServerEvent]:
    """A diarized item's final -> its speaker segments (none for a plain stream's)."""
    if r.word_speakers is None:
        return []
    return [event(SEGMENT, item_id=item_id, content_index=0, **{k: v for k, v in s.items() if k != "type"})
            for s in diarized_segments([r])]  # fmt: skip
