"""What --word-confidence costs per step: the engine's step with and without token confidences.

    python benchmarks/confidence_bench.py engine --context-right 0,13 --batch-sizes 1,16,64 \
        --out benchmarks/results/confidence_demo_cpu.json
    python benchmarks/confidence_bench.py decoder --config configs/nemotron-0.6b.yaml --batch-sizes 1,16,64

`engine`: the demo model (or --model) in an Engine, B streams of the same bundled utterances
(about --seconds each), all audio pushed at once and the loop iterated until every stream is done,
so every step is one batch of B. Two engines, confidence off and on, run in lockstep: each loop
iteration of one is followed by the same iteration of the other (in random order), and each is
timed in CPU time of this thread (time.thread_time, so that other processes on a shared machine
count less than in wall time): features, the batched step and the results (assembled in-process,
confidences included). The figure per (mode, B) is the median over all pairs of (on - off) for the
same step, the first and last chunk of each run left out; pairing cancels the slow drifts of a
busy machine that separate runs suffer. Tokens of both engines are compared.

`decoder`: the decoder half alone (NeMo's label-looping computer, as the step calls it) for a
model config's prediction network and joint with random weights (a large vocabulary such as
Nemotron's 13,088 outputs, whose encoder is too big for this CPU): random encoder frames, a bias
on the blank logit set so about a third of the frames emit (the built-ins' target), one chunk of
`valid_out_len` frames per call. Off / on alternate per call, in CPU time of this thread; the
added time is the median over pairs of (on - off).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402


def engine_part(args) -> list[dict]:
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.core.inproc import LocalEngine
    from nemo_serve.engine.loop import Engine
    from nemo_serve.model import load_model
    from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances

    clips = [u.audio for u in load_utterances(BUNDLED_MANIFEST, 16000)]
    audio = np.concatenate(clips)[: int(args.seconds * 16000)]
    rng = np.random.default_rng(0)
    rows = []
    for r in args.context_right:
        model = load_model(args.model, context_right=r)
        for b in args.batch_sizes:
            pairs: list[tuple[float, float]] = []  # (off, on) CPU seconds of the same step
            for rnd in range(args.rounds + 1):  # round 0: warm-up
                engines, results, steps = {}, {}, {}
                for conf in (False, True):
                    steps[conf] = []
                    engines[conf] = LocalEngine(Engine(model, num_slots=b, endpoint=EndpointConfig.off(), token_confidence=conf),
                                                on_step=lambda *_, c=conf: steps[c].append(1))  # fmt: skip
                    results[conf] = [[] for _ in range(b)]
                    streams = [engines[conf].open_stream(results[conf][i].append) for i in range(b)]
                    engines[conf].iterate()
                    for s in streams:
                        engines[conf].push(s, audio)
                        engines[conf].finish(s)
                k = 0
                while not all(res and res[-1].done for res in results[False] + results[True]):
                    t = {}
                    for conf in ((False, True) if rng.random() < 0.5 else (True, False)):
                        steps[conf].clear()
                        t0 = time.thread_time()
                        engines[conf].iterate()
                        t[conf] = (time.thread_time() - t0) if len(steps[conf]) == 1 else None
                    k += 1
                    if rnd and k > 1 and t[False] is not None and t[True] is not None:
                        pairs.append((t[False], t[True]))
                tokens = {c: [[x for u in res for x in u.new_token_ids] for res in results[c]] for c in results}
                assert tokens[True] == tokens[False], "confidence changed tokens"
                assert all(res[-1].token_confidences is not None for res in results[True] if any(u.new_token_ids for u in res))
            pairs = pairs[:-1]  # the last (short) chunk
            off = statistics.median(p[0] for p in pairs)
            added = statistics.median(p[1] - p[0] for p in pairs)
            row = {"part": "engine", "model": model.name, "chunk_ms": round(model.geometry.chunk_ms),
                   "vocabulary": len(model.vocabulary), "batch": b, "paired_steps": len(pairs),
                   "ms_per_step_off": round(1000 * off, 3), "ms_added_median_of_pairs": round(1000 * added, 3),
                   "percent_added": round(100 * added / off, 2), "tokens_identical": True}  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    return rows


def decoder_part(args) -> list[dict]:
    from omegaconf import OmegaConf
    from nemo.collections.asr.modules import RNNTDecoder, RNNTJoint
    from nemo.collections.asr.parts.submodules.transducer_decoding.rnnt_label_looping import (
        GreedyBatchedRNNTLabelLoopingComputer,
    )

    from nemo_serve.engine.nemo_decoder import aten_rnn, confidence_computer

    cfg = OmegaConf.load(args.config)
    vocab = int(cfg.tokenizer.vocab_size) if "tokenizer" in cfg else len(cfg.model.labels)
    dcfg, jcfg = cfg.model.decoder, cfg.model.joint
    torch.manual_seed(0)
    pred = RNNTDecoder(prednet=OmegaConf.to_container(dcfg.prednet, resolve=True), vocab_size=vocab,
                       blank_as_pad=True).eval()  # fmt: skip
    d_model = int(cfg.model.encoder.d_model)
    joint = RNNTJoint(jointnet={"encoder_hidden": d_model, "pred_hidden": int(dcfg.prednet.pred_hidden),
                                "joint_hidden": int(jcfg.jointnet.joint_hidden), "activation": "relu"},
                      num_classes=vocab).eval()  # fmt: skip
    frames = args.frames
    base = GreedyBatchedRNNTLabelLoopingComputer(pred, joint, blank_index=vocab, max_symbols_per_step=10,
                                                 allow_cuda_graphs=False)  # fmt: skip
    conf = confidence_computer(base)
    rows = []
    with torch.inference_mode(), aten_rnn(torch.device("cpu"), torch.float32):
        for b in args.batch_sizes:
            x = torch.randn(b, frames, d_model)
            lens = torch.full((b,), frames, dtype=torch.long)
            # blank bias so that about a third of the frames emit
            lo, hi = -10.0, 60.0
            bias0 = joint.joint_net[-1].bias[vocab].item()
            for _ in range(10):
                mid = (lo + hi) / 2
                joint.joint_net[-1].bias[vocab] = bias0 + mid
                hyps, _ = base(x=x, out_len=lens)
                frac = sum(len(set(hyps.timestamps[i, : hyps.current_lengths[i]].tolist())) for i in range(b)) / (b * frames)
                lo, hi = (mid, hi) if frac > 0.34 else (lo, mid)
            pairs = []
            for _ in range(args.calls):
                t = {}
                for c, comp in ((False, base), (True, conf)):
                    t0 = time.thread_time()
                    hyps, _ = comp(x=x, out_len=lens)
                    t[c] = time.thread_time() - t0
                    if not c:
                        ref = hyps.transcript[:, : int(hyps.current_lengths.max())].clone()
                    else:
                        assert torch.equal(ref, hyps.transcript[:, : ref.shape[1]]), "confidence changed tokens"
                pairs.append((t[False], t[True]))
            off = statistics.median(p[0] for p in pairs)
            on = off + statistics.median(p[1] - p[0] for p in pairs)
            row = {"part": "decoder", "config": Path(args.config).name, "joint_outputs": vocab + 1, "batch": b,
                   "frames_per_call": frames, "emit_fraction": round(frac, 3), "calls": args.calls,
                   "ms_per_call_off": round(1000 * off, 3), "ms_per_call_on": round(1000 * on, 3),
                   "ms_added": round(1000 * (on - off), 3), "percent_added": round(100 * (on - off) / off, 2)}  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("engine", "decoder"))
    ap.add_argument("--model", default=None, help="engine: model spec (default: the demo model)")
    ap.add_argument("--context-right", default="0,13")
    ap.add_argument("--config", default="configs/nemotron-0.6b.yaml", help="decoder: the model config")
    ap.add_argument("--frames", type=int, default=4, help="decoder: encoder frames per call (320 ms chunk: 4)")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.context_right = [int(x) for x in args.context_right.split(",")]
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)
    rows = engine_part(args) if args.part == "engine" else decoder_part(args)
    if args.out:
        write_json(args.out, {"run": run_record(), "argv": sys.argv[1:], "rows": rows})


if __name__ == "__main__":
    main()
