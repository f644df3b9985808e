"""A file's finals -> the bodies of OpenAI's transcription response formats.

  json          {"text", "usage"}
  text          the text and a newline
  verbose_json  {"task", "language", "duration", "text", "segments", "words", "usage"}: a segment
                per engine segment with text (the endpointer splits at pauses), with its token ids;
                words with start and end times (engine/words.py)
  srt, vtt      one cue per segment
  diarized_json {"task", "duration", "text", "segments", "usage"}: OpenAI's TranscriptionDiarized;
                a segment per run of words of one speaker within an engine segment, speaker
                "A" for the diarizer's speaker 0, "B" for 1, ... (a diarized stream's finals only)

A segment starts at its first word and ends at its last (the engine's segment also holds the
silence around them). Whisper's decoding statistics that OpenAI's segment schema requires
(avg_logprob, compression_ratio, no_speech_prob, temperature) have no RNN-T counterpart and are
fixed values, documented in docs/protocol.md.
"""

from __future__ import annotations

import math

from ..engine.results import StreamResult

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt", "diarized_json")


def transcript_text(finals: list[StreamResult]) -> str:
    return " ".join(f.text for f in finals if f.text)


def segments(finals: list[StreamResult]) -> list[dict]:
    out = []
    for f in finals:
        if not f.text:
            continue
        words = f.words or []
        start = words[0].start if words else f.segment_start_s
        end = words[-1].end if words else f.audio_processed_s
        out.append({
            "id": len(out), "seek": 0, "start": start, "end": max(start, end), "text": f.text,
            "tokens": list(f.token_ids), "temperature": 0.0, "avg_logprob": 0.0, "compression_ratio": 1.0,
            "no_speech_prob": 0.0,
            # extensions: why the engine's segment ended (an EOU model splits at its <EOU>/<EOB>)
            "end_reason": f.end_reason, "eou_probability": f.eou_probability, "backchannel": f.backchannel,
        })  # fmt: skip
    return out


def words(finals: list[StreamResult]) -> list[dict]:
    out = []
    for f in finals:
        for w in f.words or ():
            word = {"word": w.word, "start": w.start, "end": w.end}
            if w.confidence is not None:
                word["confidence"] = w.confidence  # with --word-confidence; not in OpenAI's schema
            out.append(word)
    return out


def usage(duration_s: float) -> dict:
    """OpenAI bills whole seconds of input audio: the same shape, rounded up."""
    return {"type": "duration", "seconds": math.ceil(duration_s)}


def json_body(finals: list[StreamResult], duration_s: float) -> dict:
    return {"text": transcript_text(finals), "usage": usage(duration_s)}


def verbose_body(finals: list[StreamResult], duration_s: float, language: str) -> dict:
    return {
        "task": "transcribe",
        "language": language,
        "duration": round(duration_s, 3),
        "text": transcript_text(finals),
        "segments": segments(finals),
        "words": words(finals),
        "usage": usage(duration_s),
    }


def speaker_label(speaker: int) -> str:
    """OpenAI labels unnamed speakers with capital letters; the diarizer numbers them in order of
    appearance from 0, so its speaker 0 is "A"."""
    return chr(ord("A") + speaker)


def diarized_segments(finals: list[StreamResult]) -> list[dict]:
    """Each final's words cut where the speaker changes (StreamResult.word_speakers): the speaker
    is known per token, so per word, and a segment's words share one."""
    out = []
    for f in finals:
        words = f.words or []
        runs: list[list[int]] = []  # word indices, one list per speaker run
        for i, k in enumerate(f.word_speakers or ()):
            if runs and f.word_speakers[runs[-1][-1]] == k:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            out.append({
                "type": "transcript.text.segment", "id": f"seg_{len(out)}",
                "speaker": speaker_label(f.word_speakers[run[0]]), "start": words[run[0]].start,
                "end": max(words[run[0]].start, words[run[-1]].end), "text": " ".join(words[i].word for i in run),
            })  # fmt: skip
    return out


def diarized_body(finals: list[StreamResult], duration_s: float) -> dict:
    return {
        "task": "transcribe",
        "duration": round(duration_s, 3),
        "text": transcript_text(finals),
        "segments": diarized_segments(finals),
        "usage": usage(duration_s),
    }


def subtitles(finals: list[StreamResult], kind: str) -> str:
    """SubRip (`srt`) or WebVTT (`vtt`): one cue per segment."""
    sep = "," if kind == "srt" else "."
    cues = []
    for s in segments(finals):
        span = f"{_clock(s['start'], sep)} --> {_clock(s['end'], sep)}"
        cues.append(f"{s['id'] + 1}\n{span}\n{s['text']}\n" if kind == "srt" else f"{span}\n{s['text']}\n")
    body = "\n".join(cues)
    return body if kind == "srt" else "WEBVTT\n\n" + body


def _clock(t_s: float, sep: str) -> str:
    ms = max(0, round(t_s * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"
