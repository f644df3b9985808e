"""Why a peer's tokens differ from NeMo's loop: token error rates on stream 0, adding one difference at a time.

The chunk grid (NeMo's pad-and-drop grid, sherpa-onnx's windows), the decoding rule (one symbol
per frame in sherpa-onnx), then features and ONNX Runtime numerics.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from nemo_serve.oracle import nemo_loop, whole_file_features
from nemo_serve.scoring import edit_distance


def why_peers_differ(model, audio: np.ndarray, oracle: list[int], pipeline_tokens, sherpa_tokens, onnx_dir=None) -> dict:
    """Token error rates against the oracle, adding one difference at a time (stream 0)."""
    g = model.geometry
    feats = whole_file_features(model.nemo, audio)
    total = feats.shape[-1]
    window = g.pre_cache_frames + g.chunk_frames
    sherpa_windows = [(s, s + window, g.drop_frames) for s in range(0, total - window, g.chunk_frames)]
    out = {"oracle_tokens": len(oracle)}

    def ter(tokens):
        return round(edit_distance(tokens, oracle) / max(len(oracle), 1), 4)

    def ter_between(a, b):
        return round(edit_distance(a, b) / max(len(b), 1), 4)

    # NeMo's own pad-and-drop grid (first chunk = 9 zero frames + a full chunk, drop 2 on every call).
    pad_drop = nemo_loop(model.nemo, audio, model.dtype, pad_and_drop=True).token_ids
    out["pad_and_drop_grid_nemo_features"] = ter(pad_drop)
    if pipeline_tokens is not None:
        out["pipeline"] = ter(pipeline_tokens)
        # what is left once the grid is the same: the pipeline's -16.6 pre-cache padding and 1-hop look-back features
        out["pipeline_vs_pad_and_drop_grid"] = ter_between(pipeline_tokens, pad_drop)
    # sherpa-onnx's grid: window k = frames [k*shift, k*shift + window), drop 2 always, no zero pre-cache.
    sherpa_grid = _decode_grid(model, feats, sherpa_windows, max_symbols=10)
    one_per_frame = _decode_grid(model, feats, sherpa_windows, max_symbols=1)
    out["sherpa_grid_nemo_features_max10"] = ter(sherpa_grid)
    out["sherpa_grid_nemo_features_1_per_frame"] = ter(one_per_frame)
    if sherpa_tokens is not None:
        out["sherpa"] = ter(sherpa_tokens)
        # what is left once grid and decoding rule are the same: kaldi fbank features and ONNX Runtime numerics
        out["sherpa_vs_sherpa_grid_1_per_frame"] = ter_between(sherpa_tokens, one_per_frame)
    if onnx_dir is not None:
        # the same ONNX graphs sherpa-onnx runs, fed NeMo's features on sherpa's grid: separates
        # ONNX Runtime numerics (vs the torch emulation) from sherpa's own fbank (vs sherpa)
        onnx_tokens = _decode_grid_onnx(onnx_dir, feats, sherpa_windows)
        out["onnx_sherpa_grid_nemo_features_vs_torch_emulation"] = ter_between(onnx_tokens, one_per_frame)
        if sherpa_tokens is not None:
            out["sherpa_vs_onnx_sherpa_grid_nemo_features"] = ter_between(sherpa_tokens, onnx_tokens)
    return out


@torch.inference_mode()
def _decode_grid(model, feats: torch.Tensor, windows: list[tuple[int, int, int]], max_symbols: int) -> list[int]:
    """Encode `windows` (start, end, drop) of whole-file features [1, F, T] carrying the caches, then
    greedy-decode each chunk: label looping with NeMo's max_symbols, or one symbol per frame (sherpa-onnx)."""
    nemo = model.nemo
    ch, t, n = nemo.encoder.get_initial_cache_state(batch_size=1, dtype=model.dtype)
    outs = []
    for start, end, drop in windows:
        x = feats[:, :, start:end].to(model.dtype)
        e, e_len, ch, t, n = nemo.encoder.cache_aware_stream_step(
            processed_signal=x,
            processed_signal_length=torch.tensor([x.shape[-1]]),
            cache_last_channel=ch,
            cache_last_time=t,
            cache_last_channel_len=n,
            keep_all_outputs=False,
            drop_extra_pre_encoded=drop,
        )
        outs.append(e[:, :, : int(e_len[0])])
    enc = torch.cat(outs, dim=-1)  # [1, D, T']
    if max_symbols > 1:
        hyps = nemo.decoding.rnnt_decoder_predictions_tensor(
            encoder_output=enc, encoded_lengths=torch.tensor([enc.shape[-1]]), return_hypotheses=True
        )
        return [int(x) for x in hyps[0].y_sequence.tolist()]
    return _greedy_one_symbol(nemo, enc[0].T)


def _greedy_one_symbol(nemo, enc: torch.Tensor) -> list[int]:
    """sherpa-onnx's NeMo greedy rule: at most one token per encoder frame."""
    blank = nemo.joint.num_classes_with_blank - 1
    g, state = nemo.decoder.predict(None, None, add_sos=False, batch_size=1)
    f = nemo.joint.project_encoder(enc)  # [T, H]
    out = []
    for t in range(f.shape[0]):
        p = nemo.joint.project_prednet(g)[:, 0]
        logits = nemo.joint.joint_net(f[t : t + 1] + p)
        y = int(logits.argmax(-1))
        if y != blank:
            out.append(y)
            g, state = nemo.decoder.predict(torch.tensor([[y]]), state, add_sos=False, batch_size=1)
    return out


def _decode_grid_onnx(onnx_dir: Path, feats: torch.Tensor, windows: list[tuple[int, int, int]]) -> list[int]:
    """sherpa-onnx's NeMo transducer loop (encoder with caches, one symbol per frame) in Python
    over the exported graphs, on features we choose."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    enc, dec, joi = (
        ort.InferenceSession(str(onnx_dir / f"{n}.onnx"), so, providers=["CPUExecutionProvider"])
        for n in ("encoder", "decoder", "joiner")
    )
    meta = enc.get_modelmeta().custom_metadata_map
    ch = np.zeros((1, int(meta["cache_last_channel_dim1"]), int(meta["cache_last_channel_dim2"]), int(meta["cache_last_channel_dim3"])), np.float32)
    tm = np.zeros((1, int(meta["cache_last_time_dim1"]), int(meta["cache_last_time_dim2"]), int(meta["cache_last_time_dim3"])), np.float32)
    n = np.zeros((1,), np.int64)
    layers, hidden = int(meta["pred_rnn_layers"]), int(meta["pred_hidden"])
    blank = int(meta["vocab_size"])
    dec_names = [i.name for i in dec.get_inputs()]

    def predict(token: int, h, c):
        feeds = dict(zip(dec_names, [np.array([[token]], np.int32), np.array([1], np.int32), h, c]))
        o = dec.run(None, feeds)
        return o[0], o[2], o[3]

    h = np.zeros((layers, 1, hidden), np.float32)
    c = np.zeros((layers, 1, hidden), np.float32)
    g, h1, c1 = predict(blank, h, c)
    tokens = []
    for start, end, _ in windows:
        x = feats[:, :, start:end].float().numpy()
        out, _, ch, tm, n = enc.run(None, {"audio_signal": x, "length": np.array([x.shape[-1]], np.int64),
                                           "cache_last_channel": ch, "cache_last_time": tm, "cache_last_channel_len": n})
        for t in range(out.shape[-1]):
            logits = joi.run(None, {"encoder_outputs": out[:, :, t : t + 1], "decoder_outputs": g})[0]
            y = int(logits.reshape(-1).argmax())
            if y != blank:
                tokens.append(y)
                g, h1, c1 = predict(y, h1, c1)
    return tokens
