"""The demo EOU model: the demo model's vocabulary grown by an end-of-utterance token, fine-tuned.

NVIDIA trains parakeet_realtime_eou_120m-v1 with `<EOU>` appended after each utterance's last word and
trailing silence in the audio; the corpus here already ends every utterance with 0.1-0.5 s of silence
(corpus.augment), so the recipe only appends the token to each transcript (`train --eou`). Trained so,
on one utterance per example, the model emitted nothing after its first `<EOU>` in a stream (issue 49):
`eou_corpus --n-train-turns` adds examples of 2-3 turns, each turn's words followed by its `<EOU>`.

Growing the vocabulary (`grow_tokenizer`, `grow_state`): `<EOU>` becomes a user-defined SentencePiece
piece appended after the 128 pieces (id 128; never produced by encoding text, whole when it is), so
every old id keeps its meaning and the RNN-T blank moves from 128 to 129. New rows are initialised:
- joint output and CTC output rows of `<EOU>`: a copy of the blank's row with the bias lowered by
  `EOU_BIAS_OFFSET` nats. The blank row is what fires on silence, and an EOU lives in the silence
  after speech, so the new token starts as "a less likely blank" and the loss only has to learn
  when; starting it from random rows would make it fire anywhere until trained away;
- the predictor's embedding of `<EOU>` (the label fed back after it): the mean of the token
  embeddings, a neutral context; the blank (padding) row stays the old blank's (zeros).
Every other weight is the demo model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

EOU_PIECE = "<EOU>"
EOU_BIAS_OFFSET = 4.0  # nats below the blank: the new token starts rare (module docstring)


def grow_tokenizer(src_dir: Path, out_dir: Path, pieces: tuple[str, ...] = (EOU_PIECE,)) -> Path:
    """A copy of the SentencePiece tokenizer in `src_dir` with `pieces` appended as user-defined pieces."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    proto.ParseFromString((Path(src_dir) / "tokenizer.model").read_bytes())
    existing = {p.piece for p in proto.pieces}
    for piece in pieces:
        if piece in existing:
            raise ValueError(f"{src_dir} already has {piece}")
        new = proto.pieces.add()
        new.piece, new.score, new.type = piece, 0.0, sp_pb2.ModelProto.SentencePiece.USER_DEFINED
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.model").write_bytes(proto.SerializeToString())
    with open(out_dir / "tokenizer.vocab", "w", encoding="utf-8") as f:
        f.writelines(f"{p.piece}\t{int(p.score)}\n" for p in proto.pieces)
    shutil.copy(Path(src_dir) / "vocab.txt", out_dir / "vocab.txt")
    with open(out_dir / "vocab.txt", "a", encoding="utf-8") as f:
        f.writelines(f"{piece}\n" for piece in pieces)
    return out_dir


def grow_state(state: dict[str, torch.Tensor], old_vocab: int, num_new: int) -> dict[str, torch.Tensor]:
    """The demo model's weights for a vocabulary grown by `num_new` pieces appended at `old_vocab`
    (module docstring: which rows are new and how they start)."""
    out = dict(state)
    blank = old_vocab
    for key in ("joint.joint_net.2.weight", "joint.joint_net.2.bias", "ctc_decoder.decoder_layers.0.weight",
                "ctc_decoder.decoder_layers.0.bias"):  # [V+1, ...] outputs, blank last
        w = state[key]
        new_rows = w[blank : blank + 1].repeat(num_new, *([1] * (w.dim() - 1))).clone()
        if key.endswith("bias"):
            new_rows -= EOU_BIAS_OFFSET
        out[key] = torch.cat([w[:blank], new_rows, w[blank:]], 0)
    emb = state["decoder.prediction.embed.weight"]  # [V+1, H], blank (padding) last
    mean = emb[:blank].mean(0, keepdim=True).repeat(num_new, 1)
    out["decoder.prediction.embed.weight"] = torch.cat([emb[:blank], mean, emb[blank:]], 0)
    return out


def strip_eou(text: str) -> str:
    """A transcript of the EOU model without its end-of-utterance pieces (for WER)."""
    return " ".join(text.replace(EOU_PIECE, " ").replace("<EOB>", " ").split())



def eou_token_ids(tokenizer, text: str, eou_id: int) -> list[int]:
    """The training target of one example: each turn's tokens followed by `<EOU>`. A multi-turn transcript
    (eou_corpus.turns_text) marks its turns with `<EOU>`; a plain one is one turn."""
    turns = [t.strip() for t in text.split(EOU_PIECE)]
    if len(turns) > 1 and not turns[-1]:  # the marker after the last turn
        turns.pop()
    return [i for turn in turns for i in tokenizer.text_to_ids(turn) + [eou_id]]
