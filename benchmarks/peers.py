"""The systems the step bench times, each over one batch of B equal-length streams in lockstep.

  engine    nemo_serve Engine.iterate(): features + one batched step of every ready stream
            (kv_cache=False: NeMo's own layer code, the "engine-nemo" system)
  loop      NeMo's per-stream loop (nemo_serve.oracle: conformer_stream_step, one stream at a time)
  pipeline  NeMo 3.0 CacheAwareRNNTPipeline.transcribe_step() with one Frame per stream per step
  sherpa    sherpa-onnx OnlineRecognizer.decode_streams() over an ONNX export of the model

Each returns a Measurement of its steady steps (benchmarks/measurement.py) and every stream's tokens.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.measurement import Measurement, clock, measurement, since
from nemo_serve.oracle import LoopState, loop_chunks, loop_step

_PIPELINE_MODELS: dict[tuple[str, str], object] = {}


# The phrase list of the boosted step-bench systems: 20 words the demo model was not trained on,
# spelled in lower case so any English vocabulary takes them (one tree, shared by the streams).
BENCH_PHRASES = ["zanzibar", "quinoa", "marmalade", "telescope", "volcano", "penguin", "giraffe", "saxophone",
                 "tornado", "origami", "lasagna", "cactus", "okonkwo", "nakamura", "rutherford", "bellweather",
                 "kilimanjaro", "xylophone", "jacaranda", "pemberton"]


def loaded_engine(model, audios: list[np.ndarray], on_result, kv_cache: bool = True, boosted: int = 0):
    """An engine (no thread) holding every utterance whole, pushed and finished: each iterate()
    then steps all B streams at once. on_result(i, result) receives stream i's results. The
    first `boosted` streams boost BENCH_PHRASES (engine/biasing.py)."""
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.core.inproc import LocalEngine
    from nemo_serve.engine.loop import Engine

    b = len(audios)
    eng = LocalEngine(Engine(model, num_slots=b, max_batch=b, endpoint=EndpointConfig.off(), kv_cache=kv_cache))
    for i, a in enumerate(audios):
        stream = eng.open_stream(partial(on_result, i), phrases=BENCH_PHRASES if i < boosted else None)
        eng.push(stream, a)
        eng.finish(stream)
    return eng


def run_engine(model, audios: list[np.ndarray], kv_cache: bool = True, boosted: str = "") -> Measurement:
    """Whole utterances pushed and finished up front; then iterate() until idle. `boosted`: "one"
    or "all" streams boost BENCH_PHRASES (the engine-boost1 / engine-boostall systems)."""
    b = len(audios)
    tokens: list[list[int]] = [[] for _ in audios]
    n_boosted = {"": 0, "one": 1, "all": b}[boosted]
    eng = loaded_engine(model, audios, lambda i, result: tokens[i].extend(result.new_token_ids), kv_cache, n_boosted)
    times = []
    with torch.inference_mode():
        while True:
            before = eng.stats.stream_steps
            t0 = clock()
            progressed = eng.iterate().busy
            dt = since(t0)
            if not progressed:
                break
            if eng.stats.stream_steps - before != b:
                raise RuntimeError(f"engine stepped {eng.stats.stream_steps - before} of {b} streams in one iteration")
            times.append(dt)
    name = {"": "engine", "one": "engine-boost1", "all": "engine-boostall"}[boosted] if kv_cache else "engine-nemo"
    return measurement(name, b, times, tokens)


def run_loop(model, audios: list[np.ndarray]) -> Measurement:
    """B streams served round-robin, one conformer_stream_step per stream per chunk."""
    t0 = clock()
    chunks = [loop_chunks(model.nemo, a, model.dtype) for a in audios]
    features = since(t0)
    states = [LoopState.initial(model.nemo, model.dtype) for _ in audios]
    num_chunks = len(chunks[0])
    if any(len(c) != num_chunks for c in chunks):
        raise RuntimeError("streams of unequal chunk counts")
    times = []
    for k in range(num_chunks):
        t0 = clock()
        for state, stream_chunks in zip(states, chunks):
            loop_step(model.nemo, state, *stream_chunks[k])
        times.append(since(t0))
    return measurement("loop", len(audios), times, [s.token_ids for s in states], features)


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
        return measurement("pipeline", len(audios), times, toks)


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
        return measurement("sherpa", len(audios), times, toks, features)
