"""Words of a segment from its tokens: text, start and end times, confidence.

Built on the consumer's side (a front end), from what the assembler already holds: each token's
text piece (the `Detokenizer`'s: BPE `▁` as a space, special tokens empty; a character vocabulary
as is), its encoder frame's start time, and, with --word-confidence, its decoder confidence.

- **Word**: a maximal run of non-space characters of the segment's text (`str.split()`), so
  `" ".join(w.word for w in words) == " ".join(text.split())`: the final's text, with runs of
  spaces (a lone `▁` before a `▁word`) collapsed. A token belongs to every word it gives a
  character to; a token that gives only spaces (a lone `▁`, a character model's space) or
  nothing (a special token) belongs to none.
- **start**: the start time of the word's first token's frame.
- **end**: the end of the frame of the word's last token, `(frame + 1) x frame_s`: RNN-T emits a
  token at one encoder frame and the blank run after it starts at the next frame, which is where
  the word ends (NeMo's own rule for RNN-T word offsets: a token lasts one frame). When the next
  word's first token shares that last frame (two tokens on one frame), the word ends where the
  next one starts instead, so words do not overlap; only a word whose tokens all sit on the
  next word's first frame keeps its one frame and overlaps it. Nor does a word end after the
  audio the model consumed (a stream's last frame may reach past its end). A word never ends
  before it starts.
- **confidence**: the smallest confidence of the word's tokens (NeMo's default word aggregation,
  `min`): a word is as doubtful as its least certain piece, since one wrong piece makes the word
  wrong; a mean would let a long word's sure pieces hide it. None when confidences are off.
"""

from __future__ import annotations

import msgspec


class Word(msgspec.Struct, gc=False):
    word: str
    start: float  # seconds from the start of the stream
    end: float
    confidence: float | None = None  # in [0, 1]; None without --word-confidence


def words(
    pieces: list[str], times_s: list[float], frame_s: float, confidences: list[float] | None = None,
    audio_end_s: float | None = None,
) -> list[Word]:
    """`pieces[i]`: token i's text piece; `times_s[i]`: its frame's start time; `confidences[i]`:
    its confidence in [0, 1] (or None for all); `audio_end_s`: the audio the model consumed (no
    word ends after it)."""
    spans: list[tuple[str, int, int, float]] = []  # text, first token, last token, lowest confidence
    chars: list[str] = []
    first = last = -1
    low = 1.0
    for i, piece in enumerate(pieces):
        for ch in piece:
            if ch.isspace():
                if chars:
                    spans.append(("".join(chars), first, last, low))
                    chars, first, last, low = [], -1, -1, 1.0
                continue
            if not chars:
                first = i
            chars.append(ch)
            if last != i:  # the word's next token
                last = i
                if confidences is not None:
                    low = min(low, confidences[i])
    if chars:
        spans.append(("".join(chars), first, last, low))
    out: list[Word] = []
    for k, (text, first, last, low) in enumerate(spans):
        start = times_s[first]
        end = round(times_s[last] + frame_s, 3)
        if k + 1 < len(spans):
            next_start = times_s[spans[k + 1][1]]
            if start < next_start < end:
                end = next_start
        if audio_end_s is not None and start < audio_end_s < end:
            end = audio_end_s  # the stream's last frame, padded past the end of its audio
        out.append(Word(text, start, end, round(low, 4) if confidences is not None else None))
    return out
