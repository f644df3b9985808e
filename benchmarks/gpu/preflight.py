"""gpu_bench.py phase 1: everything the run needs, checked in seconds on the smallest model (package
versions, NeMo's import, CUDA, conditional nodes, one bucket captured and stepped on the device)."""

from __future__ import annotations

import time
import traceback

import numpy as np

from benchmarks.gpu.record import Results, err, versions

def preflight(args, res: Results) -> bool:
    """Everything the run needs, checked in seconds on the smallest model; False: stop."""
    import torch

    t = time.time()
    problems: list[str] = []
    warnings_: list[str] = []
    rec: dict = {"versions": versions()}
    try:
        t_imp = time.time()
        import nemo.collections.asr  # noqa: F401

        rec["nemo_import_s"] = round(time.time() - t_imp, 1)
    except Exception as e:  # noqa: BLE001 - the message is the record
        problems.append(f"import nemo.collections.asr failed: {err(e)}")
        rec["nemo_import_traceback"] = traceback.format_exc()[-3000:]
        res.write("preflight", ok=False, seconds=round(time.time() - t, 1), problems=problems, **rec)
        return False
    if args.device == "cuda":
        if not torch.cuda.is_available():
            problems.append("CUDA is not available to torch")
        else:
            p = torch.cuda.get_device_properties(0)
            rec["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                          "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count}  # fmt: skip
        try:
            from nemo.core.utils.cuda_python_utils import check_cuda_python_cuda_graphs_conditional_nodes_supported

            check_cuda_python_cuda_graphs_conditional_nodes_supported()
            rec["conditional_nodes"] = "supported"
        except Exception as e:  # noqa: BLE001 - NeMo then decodes in no-while-loops mode (a wait per label)
            rec["conditional_nodes"] = err(e)
            warnings_.append(f"no conditional nodes: NeMo's decoder runs without while loops ({err(e)})")
    if not problems:
        try:
            rec["one_bucket"] = _one_bucket(args)
            rep = rec["one_bucket"]["report"]
            if rep["encoder_failed"]:
                problems.append(f"encoder graph capture failed: {rep['encoder_failed']}")
            if args.device == "cuda" and any(m == "no_graphs" for m in rep["decoder_modes"].values()):
                problems.append(f"NeMo's decoder could not be captured in any graph mode: {rep['decoder_failures']}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"one bucket on the device failed: {err(e)}")
            rec["one_bucket_traceback"] = traceback.format_exc()[-3000:]
    ok = not problems
    res.write("preflight", ok=ok, seconds=round(time.time() - t, 1), problems=problems, warnings=warnings_, **rec)
    if not ok:
        print("PREFLIGHT FAILED: " + "; ".join(problems), flush=True)
    return ok


def _one_bucket(args) -> dict:
    """The tiny prompt architecture on the device: bucket 2 prepared (captured on CUDA), then a
    first and a later chunk of two real rows."""
    import torch

    from benchmarks.architecture import served
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool
    from nemo_serve.engine.step import StepBatch, Stepper

    model = served("tiny-prompt", 3, args.dtype, args.device)
    encoder = make_encoder(model)
    pool = SlotPool(model, 4, encoder.channel_shape)
    stepper = Stepper(model, encoder, pool, context_right=3)
    if args.force_capture_failure:
        stepper.fail_next_decoder_capture = True
        if stepper.graphs is not None:
            stepper.graphs.fail_next_capture = True
    t = time.time()
    stepper.prepare([2])
    prepare_s = time.time() - t
    g = model.geometry
    rows = np.array([0, 1])
    pool.open_row(0), pool.open_row(1)
    tokens = 0
    for first in (True, False):
        w = g.first_frames if first else g.chunk_frames
        feats = torch.randn(2, model.num_mels, w).to(model.device)
        with torch.inference_mode():
            r = stepper.run(StepBatch(rows, feats, [w, w], first, None))
        tokens += sum(map(len, r.token_ids))
    return {"prepare_s": round(prepare_s, 2), "tokens": tokens, "report": stepper.report()}

