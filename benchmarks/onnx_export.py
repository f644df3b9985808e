"""Export a NeMo cache-aware RNN-T model the way sherpa-onnx loads NeMo streaming transducers.

`export(nemo_path, context_right, out)` writes out/encoder.onnx (NeMo's own encoder export with
cache inputs and outputs, plus the metadata sherpa-onnx's OnlineTransducerNeMoModel reads),
out/decoder.onnx, out/joiner.onnx and out/tokens.txt ("piece id" per line, `<blk>` last); the
step bench exports once per weights (`ensure_export`). Same recipe as sherpa-onnx's
scripts/nemo/nemotron-speech-streaming-en-0.6b/export_onnx.py: one encoder per chunk mode,
`window_size = chunk_size[1] + pre_encode_cache_size[1]`, `chunk_shift = chunk_size[1]`.

What the ONNX encoder computes differs from NeMo's default loop (the engine's oracle): the
export bakes in `drop_extra_pre_encoded = 2` and `keep_all_outputs = False` for every call, and
sherpa-onnx feeds window k = feature frames [k * shift, k * shift + window). See step_bench.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.common import file_digest
from nemo_serve.model import _vocabulary
from nemo_serve.nemo_private import encoder_input_width

MODEL_FILES = ("encoder.onnx", "decoder.onnx", "joiner.onnx", "tokens.txt")


def _add_metadata(path: Path, meta: dict) -> None:
    import onnx

    m = onnx.load(str(path))
    del m.metadata_props[:]
    for k, v in meta.items():
        p = m.metadata_props.add()
        p.key, p.value = k, str(v)
    onnx.save(m, str(path))


@torch.no_grad()
def export(nemo_path: Path, context_right: int, out: Path) -> dict:
    """Export one chunk mode of the model at `nemo_path` into `out`; returns the encoder metadata."""
    from nemo.collections.asr.models import ASRModel, EncDecHybridRNNTCTCModel

    out.mkdir(parents=True, exist_ok=True)
    model = ASRModel.restore_from(str(nemo_path), map_location="cpu").eval()
    if isinstance(model, EncDecHybridRNNTCTCModel):
        model.change_decoding_strategy(decoder_type="rnnt", verbose=False)
    enc = model.encoder
    modes = [list(m) for m in (getattr(enc, "att_context_size_all", None) or [enc.att_context_size])]
    mode = next((m for m in modes if m[1] == context_right), None)
    if mode is None:
        raise SystemExit(f"context right {context_right} is not a trained mode: {modes}")
    enc.set_default_att_context_size(mode)
    model.set_export_config({"cache_support": True})  # a real bool: a string "False" would be truthy
    cfg = enc.streaming_cfg
    chunk = cfg.chunk_size[1] if isinstance(cfg.chunk_size, list) else cfg.chunk_size
    pre = cfg.pre_encode_cache_size[1] if isinstance(cfg.pre_encode_cache_size, list) else cfg.pre_encode_cache_size

    vocab, _ = _vocabulary(model)
    with open(out / "tokens.txt", "w", encoding="utf-8") as f:
        for i, piece in enumerate(vocab):
            f.write(f"{piece} {i}\n")
        f.write(f"<blk> {len(vocab)}\n")

    enc.export(str(out / "encoder.onnx"))
    model.decoder.export(str(out / "decoder.onnx"))
    model.joint.export(str(out / "joiner.onnx"))
    normalize = str(model.cfg.preprocessor.get("normalize", "NA"))
    meta = {
        "vocab_size": model.decoder.vocab_size,  # without the blank
        "window_size": chunk + pre,
        "chunk_shift": chunk,
        "chunk_size_ms": (context_right + 1) * 80,
        "normalize_type": "" if normalize in ("NA", "None") else normalize,
        "cache_last_channel_dim1": len(enc.layers),
        "cache_last_channel_dim2": cfg.last_channel_cache_size,
        "cache_last_channel_dim3": enc.d_model,
        "cache_last_time_dim1": len(enc.layers),
        "cache_last_time_dim2": enc.d_model,
        "cache_last_time_dim3": enc.conv_context_size[0],
        "pred_rnn_layers": model.decoder.pred_rnn_layers,
        "pred_hidden": model.decoder.pred_hidden,
        "subsampling_factor": int(enc.subsampling_factor),
        "feat_dim": encoder_input_width(enc),
        "model_type": "EncDecHybridRNNTCTCBPEModel",
        "version": "1",
        "model_author": "NeMo",
        "comment": f"exported by nemo-serve benchmarks/export_sherpa.py from {nemo_path.name}, att_context {mode}",
    }
    _add_metadata(out / "encoder.onnx", meta)
    stamp = {"source": str(nemo_path), "source_sha256": file_digest(nemo_path), "att_context": mode, **meta}
    (out / "export.json").write_text(json.dumps(stamp, indent=1))
    return meta


def ensure_export(nemo_path: Path, context_right: int, root: Path) -> Path:
    """Export into root/<model stem>-r<R>/ unless a finished export of the same weights is already there
    (same content hash: a retrained model at the same path must not reuse the old export)."""
    out = root / f"{nemo_path.stem}-r{context_right}"
    stamp = out / "export.json"
    if stamp.exists() and all((out / f).exists() for f in MODEL_FILES):
        if json.loads(stamp.read_text()).get("source_sha256") == file_digest(nemo_path):
            return out
    export(nemo_path, context_right, out)
    return out
