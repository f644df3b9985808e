"""Average the weights of several checkpoints of one run into one ``.nemo`` (checkpoint averaging).

Late in a cosine cycle neighbouring checkpoints differ by the noise of the last few hundred updates; their
mean generalises more steadily than any one of them (the usual practice for NeMo's released models).

Usage::

    python -m nemo_serve.training.average --template work_data/ft2/best.nemo --out work_data/ft2/avg.nemo \
        work_data/ft2_ckpts/step4400.pt work_data/ft2_ckpts/step4600.pt work_data/ft2/last.pt

Each checkpoint is a trainer ``last.pt`` (its ``model`` state) or a ``.nemo``; ``--template`` is a ``.nemo``
of the same architecture whose config, tokenizer and files the output keeps.  ``--dev MANIFEST`` also scores
the result with the trainer's selection metric (dev WER alone and chained by ``--dev-chain``, their mean), so
the mean and the run's ``best.nemo`` are compared on the dev set, not on a held-out one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .evaluate import load_model


def load_state(path: str | Path) -> tuple[dict[str, torch.Tensor], int | None]:
    """(model state dict, training step if known) of a trainer checkpoint or a .nemo."""
    if str(path).endswith(".nemo"):
        return load_model(path).state_dict(), None
    st = torch.load(path, map_location="cpu", weights_only=False)
    return st["model"], st.get("step")


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating-point entries (summed in fp64); other entries (counters) from the last."""
    if not states:
        raise ValueError("nothing to average")
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError(f"checkpoints of different models: {sorted(keys ^ set(s))[:5]}")
    out = {}
    for k, last in states[-1].items():
        if last.is_floating_point():
            out[k] = (sum(s[k].double() for s in states) / len(states)).to(last.dtype)
        else:
            out[k] = last.clone()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--template", required=True, help="a .nemo of the same architecture")
    p.add_argument("--out", required=True)
    p.add_argument("--dev", default=None, help="a dev manifest to score the result on (the trainer's metric)")
    p.add_argument("--dev-limit", type=int, default=100)
    p.add_argument("--dev-chain", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("checkpoints", nargs="+")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    loaded = [load_state(c) for c in a.checkpoints]
    model = load_model(a.template)
    model.load_state_dict(average_states([s for s, _ in loaded]))
    model.save_to(a.out)
    steps = ", ".join(str(step) if step is not None else Path(c).name for c, (_, step) in zip(a.checkpoints, loaded))
    print(f"{a.out}: the mean of {len(loaded)} checkpoints ({steps})")
    if a.dev:
        from .batches import chain_dev, load_audio
        from .dev_wer import offline_wer

        wavs, texts = load_audio(Path(a.dev), a.dev_limit)
        with torch.no_grad():
            alone = offline_wer(model, wavs, texts)[0]
            chained = offline_wer(model, *chain_dev(wavs, texts, a.dev_chain), batch_size=8)[0]
        print(f"dev WER alone {alone:.4f}, chained by {a.dev_chain} {chained:.4f}; "
              f"selection metric {(alone + chained) / 2:.4f}")


if __name__ == "__main__":
    main()
