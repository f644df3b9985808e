"""Export a `train --eou` checkpoint as a `.nemo` the server loads (training/eou.py is the recipe):

    python -m nemo_serve.training.eou_export --checkpoint work_data/eou_ft/last.pt \
        --tokenizer-dir work_data/eou_tokenizer --out work_data/eou_ft/last.nemo
"""

from __future__ import annotations

from pathlib import Path

import torch


def export(checkpoint: Path, tokenizer_dir: Path, out: Path, encoder_layers: int = 6) -> Path:
    """A training run's `last.pt` (model + optimiser) as a `.nemo` the server loads (a run stopped
    before its next dev evaluation still has its latest weights here)."""
    from .model_setup import DEFAULT_CONFIG, build_model

    model = build_model(DEFAULT_CONFIG, tokenizer_dir, encoder_layers)
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False)["model"])
    model.eval().save_to(str(out))
    return out


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="export a train --eou checkpoint as .nemo")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokenizer-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--encoder-layers", type=int, default=6)
    a = p.parse_args()
    export(Path(a.checkpoint), Path(a.tokenizer_dir), Path(a.out), a.encoder_layers)
