"""CPU time of one greedy joint evaluation: NeMo's joint (log-softmax, then argmax) against
engine/greedy_joint.py (argmax of the joint net's output, log-softmax only for near-tie rows),
side by side in one run (A and B alternate, medians), with the labels checked equal.

    PYTHONPATH=. .venv/bin/python benchmarks/joint_argmax_bench.py --out benchmarks/results/joint_argmax_cpu.json

Joints: the trained demo model's, and a Nemotron-3.5-shaped one (RNNTJoint, random init: encoder
1024, predictor 640, joint hidden 640, 13,087 labels + blank). Rows: projected encoder and
predictor outputs drawn at random (the demo's from its scale: real outputs spread like these).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _joints():
    from nemo.collections.asr.modules.rnnt import RNNTJoint

    from nemo_serve.model import load_model

    demo = load_model(None).nemo.joint
    nemotron = RNNTJoint(jointnet={"encoder_hidden": 1024, "pred_hidden": 640, "joint_hidden": 640, "activation": "relu"},
                         num_classes=13087).eval()  # fmt: skip
    return {"demo": demo, "nemotron-shape": nemotron}


def _time(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def measure(joint, rows: int, rounds: int, repeats: int) -> dict:
    import torch

    from nemo_serve.engine.greedy_joint import greedy_labels

    gen = torch.Generator().manual_seed(rows)
    f = torch.randn(rows, 1, joint.joint_hidden, generator=gen)
    g = torch.randn(rows, 1, joint.joint_hidden, generator=gen)
    assert torch.equal(greedy_labels(joint, f, g, "argmax"), greedy_labels(joint, f, g, "full"))
    full, argmax = [], []
    for _ in range(rounds):  # alternate: the machine's load changes both alike
        full.append(_time(lambda: greedy_labels(joint, f, g, "full"), repeats))
        argmax.append(_time(lambda: greedy_labels(joint, f, g, "argmax"), repeats))
    a, b = statistics.median(full), statistics.median(argmax)
    return {"rows": rows, "full_us": round(a * 1e6, 1), "argmax_us": round(b * 1e6, 1), "argmax_over_full": round(b / a, 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from benchmarks.common import run_record, write_json

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    results = {}
    for name, joint in _joints().items():
        results[name] = [measure(joint, int(n), args.rounds, args.repeats) for n in args.rows.split(",")]
        print(name, results[name], flush=True)
    if args.out:
        write_json(args.out, {"run": run_record(), "vocab": {k: j.num_classes_with_blank for k, j in _joints().items()},
                              "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
