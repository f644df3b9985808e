"""Batched step time against batch size: our engine and three peers, side by side in one run.

    python benchmarks/step_bench.py --model builtin:fastconformer-l --context-right 13 \
        --batch-sizes 1,16,32 --seconds 20 --out benchmarks/results/step_fastconformer-l_r13.json

Systems, all on the same model file, the same audio (stream i gets clip i mod 8) and one thread:
  engine    nemo_serve Engine.iterate(): features + one batched step of every ready stream
  engine-nemo  the same engine with kv_cache=False: NeMo's own layer code (caches layer inputs),
            to show what the key/value cache (engine/encoder.py) buys
  pipeline  NeMo 3.0 CacheAwareRNNTPipeline.transcribe_step() with one Frame per stream per step
  loop      NeMo's per-stream loop (conformer_stream_step, one stream at a time): the oracle
  sherpa    sherpa-onnx OnlineRecognizer.decode_streams() over an ONNX export of the model

What is timed: every model step of every stream except each stream's first and last (the first
chunk has its own shape and warms caches; the last is a short tail each system handles its own
way). All streams are the same length, so every system advances them in lockstep batches of B.
Each (system, B) is warmed up on a 3-chunk run first. Rounds interleave the systems at each B so
a busy neighbour slows them alike; the figure kept per (system, B) is the median over rounds.

Features: the engine and the pipeline compute features inside the step (timed). The loop and
sherpa-onnx compute whole-utterance features up front (NeMo's streaming buffer / sherpa's
accept_waveform); that time is measured and the share of the timed chunks is added.

stream-steps/s = (B x timed steps) / time. Tokens of every system are compared with the loop's
(the oracle); for stream 0 a decomposition (grid, decoding rule, features) says why a peer differs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import bench_audio, file_digest, model_file, run_record, write_json  # noqa: E402

SYSTEMS = ("engine", "engine-nemo", "pipeline", "loop", "sherpa")


@dataclass
class Measurement:
    system: str
    batch: int
    timed_steps: int  # batched calls timed (per-stream loop: sweeps over the B streams)
    seconds: float  # wall time of the timed steps, features included (see module docstring)
    cpu_seconds: float  # process CPU time of the same (robust to a busy neighbour on a shared machine)
    feature_s: float  # part of `seconds` spent on features computed outside the step
    step_times_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def stream_steps_per_s(self) -> float:
        return self.batch * self.timed_steps / self.seconds if self.seconds > 0 else float("nan")

    @property
    def stream_steps_per_cpu_s(self) -> float:
        return self.batch * self.timed_steps / self.cpu_seconds if self.cpu_seconds > 0 else float("nan")


def clock() -> tuple[float, float]:
    """(wall, process CPU) seconds now. With one thread everything runs in this process, so CPU
    time is what the step costs when it has a core to itself; wall time includes waiting for one."""
    return time.perf_counter(), time.process_time()


def since(t: tuple[float, float]) -> tuple[float, float]:
    w, c = clock()
    return w - t[0], c - t[1]


def _steady(times: list) -> list:
    """Drop the first and the last step (see module docstring)."""
    if len(times) < 3:
        raise ValueError("need at least 3 chunks per stream to time a steady step; use longer audio")
    return times[1:-1]


def _measurement(system: str, b: int, times: list[tuple[float, float]], tokens, features=(0.0, 0.0), num_calls=None) -> Measurement:
    """Steady steps of `times` [(wall, cpu)], plus their share of features computed up front."""
    steady = _steady(times)
    share = len(steady) / (num_calls or len(times))
    fw, fc = features[0] * share, features[1] * share
    return Measurement(
        system, b, len(steady),
        sum(w for w, _ in steady) + fw, sum(c for _, c in steady) + fc, fw,
        [w for w, _ in steady], tokens,
    )  # fmt: skip


# ----------------------------------------------------------------------------- (a) our engine


def run_engine(model, audios: list[np.ndarray], kv_cache: bool = True) -> Measurement:
    """Whole utterances pushed and finished up front; then iterate() until idle (no thread)."""
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.engine.loop import Engine

    b = len(audios)
    eng = Engine(model, num_slots=b, max_batch=b, endpoint=EndpointConfig.off(), kv_cache=kv_cache)
    tokens: list[list[int]] = [[] for _ in audios]

    def collect(i, result):
        tokens[i].extend(result.new_token_ids)

    streams = [eng.open_stream(partial(collect, i)) for i in range(b)]
    for s, a in zip(streams, audios):
        eng.push(s, a)
        eng.finish(s)
    times = []
    with torch.inference_mode():
        while True:
            before = eng.stats.stream_steps
            t0 = clock()
            progressed = eng.iterate()
            dt = since(t0)
            if not progressed:
                break
            if eng.stats.stream_steps - before != b:
                raise RuntimeError(f"engine stepped {eng.stats.stream_steps - before} of {b} streams in one iteration")
            times.append(dt)
    return _measurement("engine" if kv_cache else "engine-nemo", b, times, tokens)


# ----------------------------------------------------------------------------- (c) NeMo's per-stream loop


def _loop_chunks(model, audio: np.ndarray, pad_and_drop: bool = False):
    """NeMo's CacheAwareStreamingAudioBuffer chunks of one utterance: [(chunk, lengths, is_last)]."""
    from nemo.collections.asr.parts.utils.streaming_utils import CacheAwareStreamingAudioBuffer

    buf = CacheAwareStreamingAudioBuffer(
        model=model.nemo, online_normalization=False, pad_and_drop_preencoded=pad_and_drop
    )
    buf.append_audio(np.asarray(audio, dtype=np.float32))
    out = []
    for chunk, lengths in iter(buf):
        out.append((chunk.to(model.dtype), lengths, buf.is_buffer_empty()))
    return out


@torch.inference_mode()
def _loop_stream_step(nemo, state: dict, chunk, lengths, is_last: bool, step: int, drop_first: bool = False):
    """One conformer_stream_step for one stream, exactly as nemo_serve.oracle (NeMo's example script) calls it."""
    drop = nemo.encoder.streaming_cfg.drop_extra_pre_encoded
    pred_out, _, state["ch"], state["t"], state["len"], state["hyps"] = nemo.conformer_stream_step(
        processed_signal=chunk,
        processed_signal_length=lengths,
        cache_last_channel=state["ch"],
        cache_last_time=state["t"],
        cache_last_channel_len=state["len"],
        keep_all_outputs=is_last,
        previous_hypotheses=state["hyps"],
        previous_pred_out=state["pred"],
        drop_extra_pre_encoded=drop if (step > 0 or drop_first) else 0,
        return_transcription=True,
    )
    state["pred"] = pred_out


def _loop_state(model) -> dict:
    ch, t, n = model.nemo.encoder.get_initial_cache_state(batch_size=1, dtype=model.dtype)
    return {"ch": ch, "t": t, "len": n, "hyps": None, "pred": None}


def _hyp_tokens(state: dict) -> list[int]:
    return [int(x) for x in state["hyps"][0].y_sequence.tolist()] if state["hyps"] else []


def run_loop(model, audios: list[np.ndarray]) -> Measurement:
    """B streams served round-robin, one conformer_stream_step per stream per chunk."""
    t0 = clock()
    chunks = [_loop_chunks(model, a) for a in audios]
    features = since(t0)
    states = [_loop_state(model) for _ in audios]
    num_chunks = len(chunks[0])
    if any(len(c) != num_chunks for c in chunks):
        raise RuntimeError("streams of unequal chunk counts")
    times = []
    for k in range(num_chunks):
        t0 = clock()
        for st, ch in zip(states, chunks):
            chunk, lengths, is_last = ch[k]
            _loop_stream_step(model.nemo, st, chunk, lengths, is_last, k)
        times.append(since(t0))
    return _measurement("loop", len(audios), times, [_hyp_tokens(s) for s in states], features)


# ----------------------------------------------------------------------------- (b) NeMo 3.0 pipeline


_PIPELINE_MODELS: dict[tuple[str, str], object] = {}


def _reuse_pipeline_models() -> None:
    """Let every pipeline built in this process share one restored copy of the model (the
    wrapper restores it from the .nemo path otherwise: a reload per chunk mode)."""
    from nemo.collections.asr.inference.model_wrappers.asr_inference_wrapper import ASRInferenceWrapper

    if getattr(ASRInferenceWrapper.load_model, "_nemo_serve_cached", False):
        return
    original = ASRInferenceWrapper.load_model

    def load_model(model_name, map_location):
        key = (str(model_name), str(map_location))
        if key not in _PIPELINE_MODELS:
            _PIPELINE_MODELS[key] = original(model_name, map_location)
        return _PIPELINE_MODELS[key]

    load_model._nemo_serve_cached = True
    ASRInferenceWrapper.load_model = staticmethod(load_model)


class NemoPipeline:
    """CacheAwareRNNTPipeline (it restores its own copy of the model from the .nemo, once per process)."""

    def __init__(
        self, nemo_path: Path, context_left: int, context_right: int, max_batch: int, device: str = "cpu", dtype: str = "fp32"
    ) -> None:
        from nemo.collections.asr.inference.factory.pipeline_builder import PipelineBuilder
        from omegaconf import OmegaConf

        cfg = OmegaConf.create(
            {
                "log_level": 40,
                "matmul_precision": "highest",
                "pipeline_type": "cache_aware",
                "asr_decoding_type": "rnnt",
                "asr": {
                    "model_name": str(nemo_path),
                    "device": device.split(":")[0],
                    "device_id": int(device.split(":")[1]) if ":" in device else 0,
                    "compute_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
                    "use_amp": False,
                    "decoding": {
                        "strategy": "greedy_batch",
                        "greedy": {"max_symbols": 10, "loop_labels": True, "use_cuda_graph_decoder": True},
                    },
                },
                "confidence": {
                    "exclude_blank": True,
                    "aggregation": "mean",
                    "method_cfg": {"name": "entropy", "entropy_type": "tsallis", "alpha": 0.5, "entropy_norm": "exp"},
                },
                "endpointing": {"stop_history_eou": 800, "residue_tokens_at_end": 2},
                "streaming": {
                    "sample_rate": 16000,
                    "batch_size": max_batch,
                    "num_slots": max_batch,
                    "word_boundary_tolerance": 4,
                    "att_context_size": [context_left, context_right],
                    "use_cache": True,
                    "use_feat_cache": True,
                    "chunk_size_in_secs": None,
                    "request_type": "frame",
                },
                "asr_output_granularity": "segment",
                "return_tail_result": False,
                "enable_itn": False,
                "itn": {"batch_size": 32, "n_jobs": 1, "left_padding_size": 4},  # read even with ITN off
                "enable_nmt": False,
                "nmt": None,
                "cache_dir": None,
            }
        )
        _reuse_pipeline_models()
        self.pipeline = PipelineBuilder.build_pipeline(cfg)
        self.chunk_samples = int(round(self.pipeline.chunk_size_in_secs * 16000))
        self._tokens: dict[int, list[int]] = {}
        self._ids: list[int] = []
        self._wrap_for_tokens()

    def _wrap_for_tokens(self) -> None:
        """Record each stream's hypothesis tokens as the step computes them (its state drops them at is_last)."""
        p = self.pipeline
        inner_step, inner_model_step = p.cache_aware_transcribe_step, p.asr_model.stream_step

        def transcribe_step(requests, *args, **kwargs):
            self._ids = [r.stream_id for r in requests]
            return inner_step(requests, *args, **kwargs)

        def model_step(*args, **kwargs):
            best_hyp, ctx = inner_model_step(*args, **kwargs)
            for sid, h in zip(self._ids, best_hyp):
                seq = h.y_sequence
                self._tokens[sid] = [int(x) for x in (seq.tolist() if torch.is_tensor(seq) else seq)]
            return best_hyp, ctx

        p.cache_aware_transcribe_step = transcribe_step
        p.asr_model.stream_step = model_step

    def frames(self, audios: list[np.ndarray]):
        from nemo.collections.asr.inference.streaming.framing.request import Frame
        from nemo.collections.asr.inference.streaming.framing.request_options import ASRRequestOptions

        cs = self.chunk_samples
        out = []
        for sid, a in enumerate(audios):
            n = math.ceil(len(a) / cs)
            fs = []
            for k in range(n):
                seg = a[k * cs : (k + 1) * cs]
                padded = np.zeros(cs, dtype=np.float32)
                padded[: len(seg)] = seg
                opts = ASRRequestOptions() if k == 0 else None
                fs.append(Frame(torch.from_numpy(padded), sid, k == 0, k == n - 1, len(seg), options=opts))
            out.append(fs)
        return out

    def run(self, audios: list[np.ndarray]) -> Measurement:
        frames = self.frames(audios)
        self._tokens = {}
        self.pipeline.open_session()
        times = []
        with torch.inference_mode():
            for k in range(len(frames[0])):
                t0 = clock()
                self.pipeline.transcribe_step([f[k] for f in frames])
                times.append(since(t0))
        self.pipeline.close_session()
        toks = [self._tokens.get(i, []) for i in range(len(audios))]
        return _measurement("pipeline", len(audios), times, toks)


# ----------------------------------------------------------------------------- (d) sherpa-onnx


class Sherpa:
    def __init__(self, onnx_dir: Path, feature_dim: int) -> None:
        import sherpa_onnx

        self.onnx_dir = onnx_dir
        self.rec = sherpa_onnx.OnlineRecognizer.from_transducer(
            tokens=str(onnx_dir / "tokens.txt"),
            encoder=str(onnx_dir / "encoder.onnx"),
            decoder=str(onnx_dir / "decoder.onnx"),
            joiner=str(onnx_dir / "joiner.onnx"),
            num_threads=1,
            sample_rate=16000,
            feature_dim=feature_dim,
            decoding_method="greedy_search",
            provider="cpu",
        )
        self.piece_to_id = {}
        for line in (onnx_dir / "tokens.txt").read_text(encoding="utf-8").splitlines():
            piece, idx = line.rsplit(" ", 1)
            self.piece_to_id[piece.replace("\u2581", " ")] = int(idx)  # results carry "▁" as a space

    def __call__(self, _model, audios: list[np.ndarray]) -> Measurement:
        return self.run(audios)

    def run(self, audios: list[np.ndarray]) -> Measurement:
        t0 = clock()
        streams = []
        for a in audios:
            s = self.rec.create_stream()
            s.accept_waveform(16000, a)  # computes every fbank frame now
            s.input_finished()
            streams.append(s)
        features = since(t0)
        times = []
        while True:
            ready = [s for s in streams if self.rec.is_ready(s)]
            if not ready:
                break
            if len(ready) != len(streams):
                raise RuntimeError("sherpa-onnx streams fell out of lockstep")
            t0 = clock()
            self.rec.decode_streams(ready)
            times.append(since(t0))
        toks = [[self.piece_to_id[p] for p in self.rec.get_result_all(s).tokens] for s in streams]
        return _measurement("sherpa", len(audios), times, toks, features)


# ----------------------------------------------------------------------------- token comparison


def edit_distance(a: list[int], b: list[int]) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def compare_tokens(tokens: list[list[int]], oracle: list[list[int]]) -> dict:
    identical = sum(t == o for t, o in zip(tokens, oracle))
    errors = sum(edit_distance(t, o) for t, o in zip(tokens, oracle))
    ref = sum(len(o) for o in oracle)
    return {
        "streams_identical": identical,
        "streams": len(oracle),
        "token_error_rate_vs_oracle": errors / max(ref, 1),
        "oracle_tokens": ref,
        "tokens": sum(len(t) for t in tokens),
    }


# ----------------------------------------------------------------------------- why peers differ


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


def why_peers_differ(model, audio: np.ndarray, oracle: list[int], pipeline_tokens, sherpa_tokens, onnx_dir=None) -> dict:
    """Token error rates against the oracle, adding one difference at a time (stream 0)."""
    g = model.geometry
    feats = _loop_chunks_features(model, audio)
    total = feats.shape[-1]
    window = g.pre_cache_frames + g.chunk_frames
    sherpa_windows = [(s, s + window, g.drop_frames) for s in range(0, total - window, g.chunk_frames)]
    out = {"oracle_tokens": len(oracle)}

    def ter(tokens):
        return round(edit_distance(tokens, oracle) / max(len(oracle), 1), 4)

    def ter_between(a, b):
        return round(edit_distance(a, b) / max(len(b), 1), 4)

    # NeMo's own pad-and-drop grid (first chunk = 9 zero frames + a full chunk, drop 2 on every call).
    pad_drop = _loop_tokens(model, audio, pad_and_drop=True)
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


def _loop_chunks_features(model, audio: np.ndarray) -> torch.Tensor:
    from nemo.collections.asr.parts.utils.streaming_utils import CacheAwareStreamingAudioBuffer

    buf = CacheAwareStreamingAudioBuffer(model=model.nemo, online_normalization=False)
    buf.append_audio(np.asarray(audio, dtype=np.float32))
    return buf.buffer[:, :, : int(buf.streams_length[0])]


def _loop_tokens(model, audio: np.ndarray, pad_and_drop: bool) -> list[int]:
    st = _loop_state(model)
    for k, (chunk, lengths, is_last) in enumerate(_loop_chunks(model, audio, pad_and_drop)):
        _loop_stream_step(model.nemo, st, chunk, lengths, is_last, k, drop_first=pad_and_drop)
    return _hyp_tokens(st)


# ----------------------------------------------------------------------------- driver


def warmup_audio(model, audio: np.ndarray) -> np.ndarray:
    g = model.geometry
    frames = g.first_frames + 3 * g.chunk_frames + g.pre_cache_frames
    return audio[: frames * g.hop_samples]


def with_mode(model, context_right: int):
    """The loaded model switched to another trained chunk mode (saves a reload per mode on GPU)."""
    import dataclasses

    from nemo_serve import model as served

    mode = served._select_mode(model.nemo.encoder, context_right)
    model.nemo.encoder.set_default_att_context_size(mode)
    return dataclasses.replace(model, geometry=served._geometry(model.nemo, mode))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:fastconformer-l", help=".nemo path, builtin:NAME, or demo")
    ap.add_argument("--context-right", required=True, help="one or more (comma-separated) chunk modes")
    ap.add_argument("--batch-sizes", default="1,16,32")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of every stream")
    ap.add_argument("--audio", default="synth", help="'synth' or a NeMo manifest")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--loop-max-batch", type=int, default=None, help="run the per-stream loop only up to this B")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--onnx-dir", default=None, help="where ONNX exports are cached (default: next to the .nemo)")
    ap.add_argument("--no-why", action="store_true", help="skip the token-difference decomposition")
    ap.add_argument("--out", required=True, help="JSON path; with several modes, '{r}' in it is the mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    modes = [int(r) for r in args.context_right.split(",")]
    if len(modes) > 1 and "{r}" not in args.out:
        raise SystemExit("several --context-right values need '{r}' in --out")

    from nemo_serve.model import load_model

    nemo_path, name = model_file(args.model)
    base = load_model(str(nemo_path), context_right=modes[0], dtype=args.dtype, device=args.device)
    for r in modes:
        model = base if r == modes[0] else with_mode(base, r)
        result = bench_mode(args, systems, model, nemo_path, name)
        out = args.out.replace("{r}", str(r))
        write_json(out, result)
        plot(result, Path(out).with_suffix(".png"))
        print(format_table(result))


def plot(result: dict, png: Path) -> None:
    """Stream-steps/s against batch size, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system in SYSTEMS:
        rows = sorted((r["batch"], r["stream_steps_per_s"]) for r in result["results"] if r["system"] == system)
        if rows:
            ax.plot(*zip(*rows), "-o", label=system)
    ax.set(xlabel="batch size (streams per step)", ylabel="stream-steps per second", xscale="log")
    ax.set_title(
        f"{result['model']} {result['chunk_ms']:.0f} ms {result['dtype']} on {result['device']}, "
        f"{result['threads']} thread(s)", fontsize=9
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def bench_mode(args, systems: list[str], model, nemo_path: Path, name: str) -> dict:
    record = run_record()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(model.summary(max(sizes)), file=sys.stderr)
    peers = _build_peers(systems, model, nemo_path, args, max(sizes))
    onnx_dir = getattr(peers.get("sherpa"), "onnx_dir", None)
    audios = bench_audio(max(sizes), args.seconds, args.audio)
    runs: dict[tuple[str, int], list[Measurement]] = {}
    plan = [(b, s) for b in sizes for s in systems if not (s == "loop" and args.loop_max_batch and b > args.loop_max_batch)]
    bar = _progress(len(plan) * args.rounds)
    for r in range(args.rounds):
        for b, system in plan:
            runner = _synced(peers[system], model.device)
            if r == 0:
                runner(model, [warmup_audio(model, a) for a in audios[:b]])
            m = runner(model, audios[:b])
            runs.setdefault((system, b), []).append(m)
            bar.update(1)
            bar.set_postfix_str(f"{system} B={b}: {m.stream_steps_per_s:.1f} stream-steps/s")
    bar.close()
    return _summarise(args, record, name, nemo_path, model, sizes, runs, audios, onnx_dir)


def _synced(runner, device: torch.device):
    """Every timed call already ends in a device-to-host copy; synchronise once more after a run."""
    if device.type != "cuda":
        return runner

    def run(model, audios):
        torch.cuda.synchronize()
        m = runner(model, audios)
        torch.cuda.synchronize()
        return m

    return run


def _build_peers(systems, model, nemo_path: Path, args, max_batch: int) -> dict:
    peers = {}
    if "engine" in systems:
        peers["engine"] = run_engine
    if "engine-nemo" in systems:
        peers["engine-nemo"] = partial(run_engine, kv_cache=False)
    if "loop" in systems:
        peers["loop"] = run_loop
    if "pipeline" in systems:
        g = model.geometry
        pipe = NemoPipeline(nemo_path, g.context_left, g.context_right, max_batch, args.device, args.dtype)
        peers["pipeline"] = lambda _m, audios: pipe.run(audios)
    if "sherpa" in systems:
        from benchmarks.export_sherpa import ensure_export

        if args.device != "cpu":
            raise SystemExit("sherpa-onnx runs here on CPU only (the PyPI wheel has no CUDA provider); drop it from --systems")
        root = Path(args.onnx_dir) if args.onnx_dir else nemo_path.parent / "onnx"
        peers["sherpa"] = Sherpa(ensure_export(nemo_path, model.geometry.context_right, root), model.num_mels)
    return peers


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="step_bench", file=sys.stderr)
    except ImportError:  # pragma: no cover
        class _Bar:
            def update(self, n): ...
            def set_postfix_str(self, s): print(s, file=sys.stderr)
            def close(self): ...

        return _Bar()


def _oracle_by_clip(runs: dict) -> list[list[int]] | None:
    """NeMo's loop tokens per audio clip (stream i plays clip i mod 8), from its largest run."""
    loops = sorted(b for (s, b) in runs if s == "loop")
    if not loops:
        return None
    tokens = runs[("loop", loops[-1])][0].tokens
    return tokens[: min(len(tokens), 8)]


def _summarise(args, record, name, nemo_path, model, sizes, runs, audios, onnx_dir=None) -> dict:
    g = model.geometry
    oracle = _oracle_by_clip(runs)
    results = []
    for (system, b), ms in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rates = [m.stream_steps_per_s for m in ms]
        cpu_rates = [m.stream_steps_per_cpu_s for m in ms]
        median_run = ms[int(np.argsort(rates)[len(rates) // 2])]
        step_ms = [1000 * t for m in ms for t in m.step_times_s]
        row = {
            "system": system,
            "batch": b,
            "stream_steps_per_s": statistics.median(rates),
            "stream_steps_per_s_rounds": rates,
            "stream_steps_per_cpu_s": statistics.median(cpu_rates),
            "stream_steps_per_cpu_s_rounds": cpu_rates,
            "cpu_share_of_wall": round(statistics.median(m.cpu_seconds / m.seconds for m in ms), 3),
            "step_ms_median": statistics.median(step_ms),
            "step_ms_p95": float(np.percentile(step_ms, 95)),
            "timed_steps": median_run.timed_steps,
            "feature_s_added": median_run.feature_s,
            "realtime_streams": statistics.median(rates) * g.chunk_ms / 1000.0,
        }
        if oracle is not None and len(oracle) >= min(b, 8):
            row["tokens_vs_oracle"] = compare_tokens(median_run.tokens, [oracle[i % len(oracle)] for i in range(b)])
        results.append(row)
    why = None
    if oracle is not None and not args.no_why:
        first = {s: runs[(s, b)][0].tokens[0] for (s, b) in sorted(runs) if s in ("pipeline", "sherpa")}
        why = why_peers_differ(model, audios[0], oracle[0], first.get("pipeline"), first.get("sherpa"), onnx_dir)
    return {
        "benchmark": "step_bench",
        **record,
        "model": name,
        "model_file": str(nemo_path),
        "model_sha256": file_digest(nemo_path),
        "model_parameters": model.num_parameters,
        "dtype": args.dtype,
        "device": args.device,
        "context": [g.context_left, g.context_right],
        "chunk_ms": g.chunk_ms,
        "seconds_per_stream": args.seconds,
        "audio": args.audio,
        "rounds": args.rounds,
        "threads": args.threads,
        "cache_bytes_per_stream": _engine_cache_bytes(model),  # the engine's layout (keys/values)
        "cache_bytes_per_stream_nemo_layout": model.cache_bytes_per_stream,
        "results": results,
        "ratios": _ratios(results, sizes),
        "ratios_cpu_time": _ratios(results, sizes, "stream_steps_per_cpu_s_rounds"),
        "why_tokens_differ_stream0": why,
    }


def _engine_cache_bytes(model) -> int:
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool

    return SlotPool(model, 1, make_encoder(model.nemo.encoder).channel_shape).cache_bytes_per_stream


def _ratios(results: list[dict], sizes: list[int], key: str = "stream_steps_per_s_rounds") -> dict:
    """engine / peer stream-steps/s per batch size: the median over rounds of each round's ratio
    (a round measures every system at that B back to back, so a busy neighbour hits both alike)."""
    by = {(r["system"], r["batch"]): r[key] for r in results}
    out = {}
    for b in sizes:
        e = by.get(("engine", b))
        if e is None:
            continue
        out[str(b)] = {
            f"engine_over_{p}": round(statistics.median(x / y for x, y in zip(e, by[(p, b)])), 3)
            for p in ("sherpa", "pipeline", "loop", "engine-nemo")
            if (p, b) in by
        }
    return out


def format_table(result: dict) -> str:
    sizes = sorted({r["batch"] for r in result["results"]})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in result["results"])]
    by = {(r["system"], r["batch"]): r for r in result["results"]}
    lines = [
        f"{result['model']} {result['chunk_ms']:.0f} ms chunks, {result['dtype']}, {result['threads']} thread(s); "
        "stream-steps per wall s / per CPU s (median step ms)",
        "| system | " + " | ".join(f"B={b}" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for s in systems:
        cells = []
        for b in sizes:
            r = by.get((s, b))
            cells.append(
                f"{r['stream_steps_per_s']:.1f} / {r['stream_steps_per_cpu_s']:.1f} ({r['step_ms_median']:.0f})" if r else "-"
            )
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for name, ratios in (("wall", result["ratios"]), ("cpu", result["ratios_cpu_time"])):
        for b, rs in ratios.items():
            lines.append(f"{name} B={b}: " + ", ".join(f"{k} {v:.2f}x" for k, v in rs.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
