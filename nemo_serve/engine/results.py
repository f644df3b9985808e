"""What a step produces for one stream (`StreamUpdate`, only what changed) and what a consumer
reads (`StreamResult`, the segment so far), and the assembler that turns one into the other.

The engine emits updates: new token ids and their encoder frames, flags and times. Text and the
segment's token list are built by the consumer's `ResultAssembler`, on the consumer's side: in
a front-end process, so the engine core never detokenises (in the in-process harness: the
engine's own thread). Importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from .words import Word, words


class StreamUpdate(msgspec.Struct, array_like=True, gc=False):
    """One step's news for one stream (crosses the process boundary as msgpack)."""

    stream_id: str
    segment: int
    is_final: bool
    done: bool  # no update follows this one
    new_token_ids: list[int]
    new_token_frames: list[int]  # global encoder frame of each new token
    segment_start_frame: int
    audio_processed_s: float  # audio consumed by the model so far
    audio_arrival_time: float  # server time.time() when the last sample that produced this arrived
    error: str | None = None
    new_token_confidences: list[float] | None = None  # one per new token, with --word-confidence
    # Finals only: why the segment ended (END_REASONS) and, for "eou"/"eob", the end-of-utterance
    # token's probability and encoder frame (engine/eou.py; the token itself is never sent).
    end_reason: str | None = None
    eou_probability: float | None = None
    eou_frame: int = -1
    # Diarized streams only (engine/speakers.py): each new token's speaker (0-based, below the
    # stream's max_speakers) and, on finals, the speaker of most of the segment's tokens.
    new_token_speakers: list[int] | None = None
    speaker: int | None = None


# Why a final closed its segment: the model's end-of-utterance / end-of-backchannel token, the
# silence rules (engine/endpoint.py rules 1 and 2), the length rule (rule 3), the client (a force
# final, a realtime commit), the end of the stream's input, or (a diarized stream that asked for
# it) another speaker (engine/speakers.py).
END_REASONS = ("eou", "eob", "silence", "max_length", "force_final", "end_of_input", "speaker_change")


@dataclass
class StreamResult:
    """What a stream's consumer receives after a step (or at an endpoint / end of input)."""

    stream_id: str
    text: str  # text of the current segment (partial) or of the closed segment (final)
    segment: int
    is_final: bool
    new_token_ids: list[int]  # tokens decoded by the step that produced this result
    token_ids: list[int]  # all tokens of the segment so far
    token_times_s: list[float]  # start time of each token of the segment (encoder frame * frame_s)
    segment_start_s: float
    audio_processed_s: float  # audio consumed by the model so far
    audio_arrival_time: float  # server time.time() when the last sample that produced this arrived
    done: bool = False  # no result follows this one
    error: str | None = None
    # Finals only: the segment's words (engine/words.py) and, with --word-confidence, each token's
    # confidence in [0, 1] (engine/step.py).
    token_confidences: list[float] | None = None
    words: list[Word] | None = None
    end_reason: str | None = None  # finals: one of END_REASONS
    eou_probability: float | None = None  # finals ended by "eou"/"eob": the token's probability
    eou_time_s: float | None = None  # finals ended by "eou"/"eob": the token's audio time
    backchannel: bool = False  # an "eob" final: an acknowledgement ("uh-huh"), not a turn
    # Diarized streams: each token's speaker (as token_ids) and, on finals, the segment's speaker
    # (engine/speakers.py); on finals, each word's speaker (its first token's, so its start time's).
    token_speakers: list[int] | None = None
    speaker: int | None = None
    word_speakers: list[int] | None = None

    @property
    def ended_by_model(self) -> bool:
        return self.end_reason in ("eou", "eob")


class Detokenizer:
    """Token id -> text piece, so text grows by appending (never re-decoding the hypothesis)."""

    def __init__(self, vocabulary: list[str], is_bpe: bool) -> None:
        if is_bpe:
            self.pieces = [p.replace("▁", " ") if not (p.startswith("<") and p.endswith(">")) else "" for p in vocabulary]
        else:
            self.pieces = list(vocabulary)

    def piece(self, token_id: int) -> str:
        return self.pieces[token_id] if token_id < len(self.pieces) else ""

    def text(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[t] for t in token_ids if t < len(self.pieces))


class ResultAssembler:
    """One stream's segment state on the consumer side: updates in, results out."""

    def __init__(self, detok: Detokenizer, frame_s: float) -> None:
        self.detok = detok
        self.frame_s = frame_s
        self.token_ids: list[int] = []
        self.token_times_s: list[float] = []
        self.token_confidences: list[float] | None = []  # None once a token came without one
        self.token_speakers: list[int] = []  # diarized streams only
        self.text = ""

    def __call__(self, u: StreamUpdate) -> StreamResult:
        if u.new_token_ids:
            self.token_ids.extend(u.new_token_ids)
            self.token_times_s.extend(round(f * self.frame_s, 3) for f in u.new_token_frames)
            self.text += self.detok.text(u.new_token_ids)
            if u.new_token_confidences is None or self.token_confidences is None:
                self.token_confidences = None
            else:
                self.token_confidences.extend(u.new_token_confidences)
            if u.new_token_speakers is not None:
                self.token_speakers.extend(u.new_token_speakers)
        r = StreamResult(
            stream_id=u.stream_id,
            text=self.text.strip(),
            segment=u.segment,
            is_final=u.is_final,
            new_token_ids=u.new_token_ids,
            token_ids=list(self.token_ids),
            token_times_s=list(self.token_times_s),
            segment_start_s=round(u.segment_start_frame * self.frame_s, 3),
            audio_processed_s=u.audio_processed_s,
            audio_arrival_time=u.audio_arrival_time,
            done=u.done,
            error=u.error,
            token_speakers=list(self.token_speakers) if u.new_token_speakers is not None else None,
            speaker=u.speaker,
        )
        if u.is_final:  # the segment is closed: the next update starts a new one
            r.end_reason, r.eou_probability, r.backchannel = u.end_reason, u.eou_probability, u.end_reason == "eob"
            if u.eou_frame >= 0:
                r.eou_time_s = round(u.eou_frame * self.frame_s, 3)
            r.token_confidences = self.token_confidences if self.token_confidences and self.token_ids else None
            r.words = words(
                [self.detok.piece(t) for t in self.token_ids], self.token_times_s, self.frame_s, r.token_confidences,
                u.audio_processed_s,
            )
            if self.token_speakers:
                by_time = dict(zip(self.token_times_s, self.token_speakers))  # tokens of one frame: one speaker
                r.word_speakers = [by_time[w.start] for w in r.words]
            self.token_ids, self.token_times_s, self.text, self.token_confidences = [], [], "", []
            self.token_speakers = []
        return r
