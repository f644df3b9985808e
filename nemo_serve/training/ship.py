"""Ship a trained checkpoint as the package's default demo model, plus bundled test utterances.

* ``demo.nemo``: the trained ``.nemo`` with its parameters stored in fp16 inside ``model_weights.ckpt``
  (halves the file; ``restore_from`` copies them into the fp32 model, so the loaded model is fp32; buffers
  such as the mel filterbank stay fp32).  The WERs in docs/demo_model.md are measured on this file.
* ``utterances/NNN.wav`` + ``utterances/manifest.jsonl``: 24 held-out utterances (8 from each of
  heldout_sentences / heldout_voices / flite), 2-6 s, 16 kHz mono; ``audio_filepath`` relative to the manifest.

Usage::

    python -m nemo_serve.training.ship --model work_data/run1/best.nemo --data work_data/corpus [--no-utterances]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import torch

from ..audio_io import read_manifest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "nemo_serve" / "assets" / "demo"
SETS = ["heldout_sentences", "heldout_voices", "flite"]


def shrink_nemo(src: Path, dst: Path) -> None:
    """Rewrite a .nemo so that floating-point *parameters* are stored as fp16 (buffers untouched)."""
    from nemo.collections.asr.models import ASRModel

    model = ASRModel.restore_from(str(src), map_location=torch.device("cpu"))
    param_names = {n for n, _ in model.named_parameters()}
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        with tarfile.open(src, "r:*") as tar:
            tar.extractall(td, filter="data")
        ck = next(td.rglob("model_weights.ckpt"))
        sd = torch.load(ck, map_location="cpu", weights_only=False)
        sd = {k: (v.half() if k in param_names and v.is_floating_point() else v) for k, v in sd.items()}
        torch.save(sd, ck)
        tmp = dst.with_suffix(".tmp")
        with tarfile.open(tmp, "w:") as tar:
            tar.add(td, arcname=".")
        tmp.replace(dst)


def pick_utterances(data: Path, per_set: int = 8, lo: float = 2.0, hi: float = 6.0) -> list[dict]:
    out = []
    for s in SETS:
        rows = read_manifest(data / f"{s}.jsonl")
        seen_voices, chosen = set(), []
        ok = [r for r in rows if lo + 0.05 <= r["duration"] <= hi - 0.05]
        for r in ok:  # prefer distinct voices, in manifest order (deterministic)
            if len(chosen) < per_set and r["voice"] not in seen_voices:
                chosen.append(r)
                seen_voices.add(r["voice"])
        for r in ok:  # fill up (flite has only 5 voices)
            if len(chosen) < per_set and r not in chosen:
                chosen.append(r)
        for r in chosen:
            out.append({**r, "set": s, "src": str(data / r["audio_filepath"])})
    return out


def ship(model: Path, data: Path | None, utterances: bool = True) -> None:
    DEMO.mkdir(parents=True, exist_ok=True)
    shrink_nemo(model, DEMO / "demo.nemo")
    print(f"wrote {DEMO / 'demo.nemo'} ({(DEMO / 'demo.nemo').stat().st_size / 1e6:.1f} MB)")
    if not utterances:
        return
    udir = DEMO / "utterances"
    if udir.exists():
        shutil.rmtree(udir)
    udir.mkdir(parents=True)
    rows = pick_utterances(data)
    with open(udir / "manifest.jsonl", "w") as f:
        for i, r in enumerate(rows):
            name = f"{i:03d}.wav"
            shutil.copyfile(r["src"], udir / name)
            f.write(json.dumps({"audio_filepath": name, "text": r["text"], "duration": r["duration"],
                                "set": r["set"], "voice": r["voice"]}) + "\n")
    print(f"wrote {len(rows)} utterances to {udir}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=None)
    p.add_argument("--no-utterances", action="store_true")
    a = p.parse_args(argv)
    ship(Path(a.model), Path(a.data) if a.data else None, utterances=not a.no_utterances)


if __name__ == "__main__":
    main()
