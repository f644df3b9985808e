"""End-of-utterance tokens: a model that says when a turn is over.

NVIDIA's cache-aware EOU models (parakeet_realtime_eou_120m-v1) emit `<EOU>` after an utterance's
last word, and their exports also carry `<EOB>` (end of a backchannel: "uh-huh", "right"). NeMo's
voice agent (nemo/agents/voice_agent/pipecat/services/nemo/streaming_asr.py, turn_taking.py) spells
them so, ends the user's turn on them and reports the token's softmax probability. The ids come from
the tokenizer's pieces, never from one checkpoint's numbering.

The engine keeps the tokens as the decoder emits them (so they equal NeMo's loop, EOU included) and
only changes how they are presented: an EOU token is cut out of what clients see and closes the
segment it ends (engine/publish.py). Unlike NeMo's voice agent, which resets the encoder and decoder
state at an EOU, the engine carries state on, as at any endpoint (engine/endpoint.py): the tokens of
all segments together stay NeMo's cache-aware loop's.

Probability: the step reports NeMo's `max_prob` confidence with alpha 1, c = (p*v - 1)/(v - 1) over
the v joint outputs (blank included, engine/nemo_decoder.py `confidence_computer`); `probability` inverts it.
"""

from __future__ import annotations

from dataclasses import dataclass

EOU_PIECE = "<EOU>"  # end of utterance: the user's turn is over
EOB_PIECE = "<EOB>"  # end of backchannel: a short acknowledgement, not a turn
PIECE_TO_REASON = {EOU_PIECE: "eou", EOB_PIECE: "eob"}


@dataclass(frozen=True)
class EouCut:
    """The tokens of a segment an EOU token closed, and the token itself."""

    ids: list[int]
    frames: list[int]
    confidences: list[float] | None
    reason: str  # "eou" | "eob"
    probability: float | None  # the EOU token's softmax probability (None without confidences)
    frame: int  # the EOU token's encoder frame


@dataclass(frozen=True)
class EouTokens:
    """The vocabulary's end-of-utterance ids; empty for an ordinary model."""

    id_to_reason: dict[int, str]
    num_outputs: int  # joint outputs, blank included (the confidence's v)

    @classmethod
    def from_vocabulary(cls, vocabulary: list[str]) -> "EouTokens":
        found = {i: PIECE_TO_REASON[p] for i, p in enumerate(vocabulary) if p in PIECE_TO_REASON}
        return cls(found, len(vocabulary) + 1)

    def __bool__(self) -> bool:
        return bool(self.id_to_reason)

    def probability(self, confidence: float) -> float:
        v = self.num_outputs
        return round((confidence * (v - 1) + 1) / v, 6)

    def split(self, ids: list[int], frames: list[int], confs: list[float] | None
              ) -> tuple[list[EouCut], tuple[list[int], list[int], list[float] | None]]:  # fmt: skip
        """One step's new tokens of a stream -> the segments its EOU tokens close (in order) and
        the tokens after the last one (the open segment's), all without EOU tokens."""
        cuts: list[EouCut] = []
        start = 0
        for i, token in enumerate(ids):
            reason = self.id_to_reason.get(token)
            if reason is None:
                continue
            prob = self.probability(confs[i]) if confs is not None else None
            cuts.append(EouCut(ids[start:i], frames[start:i], confs[start:i] if confs is not None else None,
                               reason, prob, frames[i]))  # fmt: skip
            start = i + 1
        rest = (ids[start:], frames[start:], confs[start:] if confs is not None else None)
        return cuts, rest

    def strip(self, ids: list[int], frames: list[int], confs: list[float] | None
              ) -> tuple[list[int], list[int], list[float] | None]:  # fmt: skip
        """The tokens without EOU tokens (a stream with EOU endings off)."""
        keep = [i for i, t in enumerate(ids) if t not in self.id_to_reason]
        if len(keep) == len(ids):
            return ids, frames, confs
        return [ids[i] for i in keep], [frames[i] for i in keep], [confs[i] for i in keep] if confs is not None else None
