"""What a diarized stream costs against a plain one: the engine's CPU time per step, side by side.

    python benchmarks/diarization_cost.py --out benchmarks/results/diarization_cost_cpu.json

B streams of the same synthetic audio in one in-process engine (core/inproc.py, the production
core), all plain or all diarized ({"max_speakers": 4}), their audio pushed at once so each ASR step
holds all B rows (and each diarizer step too). Timed: every iterate() until the last stream is
released, i.e. the ASR steps, the diarizer steps (diarized runs only) and the host work around
them, divided by the ASR steps (the same count in both runs). Plain and diarized runs alternate,
--repeats of each; the medians' ratio is the cost of diarization per step. One CPU thread.

Models: the ASR model --model (default: the shipped demo model) beside the diarizer --diarizer
(default builtin:tiny-sortformer, toy width) at --setting (default: the server's, diarization/load.py).
A ratio holds for that pair of sizes only: a 4-speaker Sortformer at NVIDIA's width beside a small
ASR model costs relatively more.
Where the two preprocessors are the same (builtin:demo-sortformer beside the demo model), the
diarizer takes its feature frames from the ASR side (diarization/shared_features.py);
--before-shared adds diarized runs on its own features, interleaved. `--diarizer tiny-sortformer-80`:
tiny-sortformer with the demo model's 80 mels (benchmark only: the toy-width diarizer of the
earlier cost tables, now sharing the demo model's preprocessor).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from nemo_serve.core.inproc import LocalEngine  # noqa: E402
from nemo_serve.diarization import pre_encode  # noqa: E402
from nemo_serve.diarization.load import DEFAULT_SETTING, load_diarizer  # noqa: E402
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings  # noqa: E402
from nemo_serve.diarization.shared_features import feature_differences  # noqa: E402
from nemo_serve.engine.endpoint import EndpointConfig  # noqa: E402
from nemo_serve.engine.loop import Engine  # noqa: E402
from nemo_serve.model import load_model  # noqa: E402
from nemo_serve.synth import synth_audio  # noqa: E402


def load_benchmark_diarizer(spec: str):
    """load_diarizer's, or `tiny-sortformer-80` (module docstring), set up as load_diarizer sets one up."""
    if spec != "tiny-sortformer-80":
        return load_diarizer(spec)
    from nemo.collections.asr.models import SortformerEncLabelModel
    from omegaconf import OmegaConf

    from nemo_serve.builtin.sortformer import HeadRecipe, _calibrate_speaker_head, diarizer_spec

    cfg = diarizer_spec("tiny-sortformer")
    cfg.model.preprocessor.features = cfg.model.encoder.feat_in = 80
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = SortformerEncLabelModel(cfg=cfg.model.copy()).float().eval()
    _calibrate_speaker_head(model, HeadRecipe(**OmegaConf.to_container(cfg.get("random_init", {}))))
    model.streaming_mode = model.async_streaming = True
    apply_settings(model, MODEL_CARD_SETTINGS[DEFAULT_SETTING])
    return model


def timed_run(model, diarizer, batch: int, audio, diarized: bool, reuse_features: bool = True,
              masks_padded_rows_only: bool = True, share_features: bool = True) -> dict:  # fmt: skip
    """One run: B streams of `audio`, all diarized or all plain; seconds and step counts.
    `reuse_features` False: the diarizer computes each chunk's whole feature window (the version
    before diarization/features.py); `masks_padded_rows_only` False: NeMo's pre-encoder forward,
    every row masked (the version before diarization/pre_encode.py); `share_features` False: the
    diarizer's own preprocessor even where the ASR model's is the same (the version before
    diarization/shared_features.py); for a before/after in one run."""
    pre_encode.MASK_PADDED_ROWS_ONLY = masks_padded_rows_only
    engine = LocalEngine(Engine(model, num_slots=batch, max_batch=batch, endpoint=EndpointConfig.off(), diarizer=diarizer))
    engine.engine.diarizer.reuse_features = reuse_features
    shares = engine.engine.diarizer.shares_asr_features
    engine.engine.diarizer.shares_asr_features = shares and share_features and reuse_features
    done = []
    option = {"max_speakers": 4} if diarized else None
    handles = [engine.open_stream(lambda r: done.append(r) if r.done else None, diarization=option) for _ in range(batch)]
    for h in handles:
        engine.push(h, audio)
        engine.finish(h)
    asr_steps = asr_rows = diar_rows = iterations = 0
    start, cpu_start = time.perf_counter(), time.thread_time()
    while len(done) < batch or engine.num_open_streams:
        out = engine.iterate()
        iterations += 1
        asr_steps += len(out.steps)
        asr_rows += sum(s.batch_size for s in out.steps)
        diar_rows += out.diarized_rows
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    assert diarized or engine.engine.diarizer.num_steps == 0  # plain streams: no diarizer work
    return {"seconds": elapsed, "asr_steps": asr_steps, "asr_rows": asr_rows, "diarizer_rows": diar_rows,
            "diarizer_steps": engine.engine.diarizer.num_steps, "iterations": iterations,
            "diarizer_seconds": engine.engine.diarizer.seconds,  # its plan (features), step and collect
            "diarizer_feature_seconds": engine.engine.diarizer.feature_seconds,  # of which its preprocessor
            "diarizer_shares_asr_features": engine.engine.diarizer.shares_asr_features,
            "ms_per_asr_step": 1e3 * elapsed / max(asr_steps, 1),
            # this thread's CPU time (one torch thread: all the work is on it); on a shared machine
            # it moves less than the wall clock, which counts the time other processes hold the core
            "cpu_ms_per_asr_step": 1e3 * cpu / max(asr_steps, 1)}  # fmt: skip


def measure(model, diarizer, batch: int, audio, repeats: int, before: bool, before_masks: bool = False,
            before_shared: bool = False) -> dict:  # fmt: skip
    kinds = ("plain", "diarized") + (("diarized_before",) if before else ()) + (("diarized_before_masks",) if before_masks else ())
    kinds += ("diarized_before_shared",) if before_shared else ()
    runs = {k: [] for k in kinds}
    for _ in range(repeats):
        for kind in kinds:
            runs[kind].append(timed_run(model, diarizer, batch, audio, kind != "plain", kind != "diarized_before",
                                        kind != "diarized_before_masks", kind != "diarized_before_shared"))  # fmt: skip
    med = {k: statistics.median(r["ms_per_asr_step"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_ms_per_asr_step"] for r in v) for k, v in runs.items()}
    share = statistics.median(r["diarizer_seconds"] / r["seconds"] for r in runs["diarized"])
    features_ms = {k: statistics.median(1e3 * r["diarizer_feature_seconds"] / max(r["diarizer_steps"], 1) for r in v)
                   for k, v in runs.items() if k != "plain"}  # fmt: skip
    row = {"batch": batch, "plain_ms_per_step": round(med["plain"], 3), "diarized_ms_per_step": round(med["diarized"], 3),
           "ratio": round(med["diarized"] / med["plain"], 3), "diarizer_share_of_diarized_time": round(share, 3)}  # fmt: skip
    row["diarizer_feature_ms_per_step"] = round(features_ms["diarized"], 3)
    row.update(plain_cpu_ms_per_step=round(cpu["plain"], 3), diarized_cpu_ms_per_step=round(cpu["diarized"], 3),
               ratio_cpu=round(cpu["diarized"] / cpu["plain"], 3))  # fmt: skip
    if before_masks:
        row.update(diarized_before_masks_ms_per_step=round(med["diarized_before_masks"], 3),
                   ratio_before_masks=round(med["diarized_before_masks"] / med["plain"], 3),
                   diarized_before_masks_cpu_ms_per_step=round(cpu["diarized_before_masks"], 3),
                   ratio_cpu_before_masks=round(cpu["diarized_before_masks"] / cpu["plain"], 3))
    if before_shared:
        row.update(diarized_before_shared_ms_per_step=round(med["diarized_before_shared"], 3),
                   ratio_before_shared=round(med["diarized_before_shared"] / med["plain"], 3),
                   diarized_before_shared_cpu_ms_per_step=round(cpu["diarized_before_shared"], 3),
                   ratio_cpu_before_shared=round(cpu["diarized_before_shared"] / cpu["plain"], 3),
                   diarizer_feature_ms_per_step_before_shared=round(features_ms["diarized_before_shared"], 3))
    if before:
        row.update(diarized_before_ms_per_step=round(med["diarized_before"], 3),
                   ratio_before=round(med["diarized_before"] / med["plain"], 3),
                   diarizer_feature_ms_per_step_before=round(features_ms["diarized_before"], 3))
    return {**row, "runs": runs}


def measure_setting(model, diarizer, setting: str, audio, args) -> dict:
    apply_settings(diarizer, MODEL_CARD_SETTINGS[setting])
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        rows.append(measure(model, diarizer, batch, audio, args.repeats, args.before, args.before_masks, args.before_shared))
        r = rows[-1]
        print(f"{setting} B={batch}: plain {r['plain_ms_per_step']} ms/step, diarized {r['diarized_ms_per_step']} "
              f"ms/step, ratio {r['ratio']}x" + (f" (before: {r['ratio_before']}x)" if args.before else "")
              + (f" (before, masks: {r['ratio_before_masks']}x)" if args.before_masks else "")
              + f"; CPU time ratio {r['ratio_cpu']}x" + (f" (before, masks: {r['ratio_cpu_before_masks']}x)" if args.before_masks else "")
              + (f" (before, own features: {r['ratio_cpu_before_shared']}x)" if args.before_shared else ""),
              flush=True)  # fmt: skip
    return {"diarizer_setting": setting, "target_met": rows[-1]["ratio"] <= args.target,
            "target_met_cpu_time": rows[-1]["ratio_cpu"] <= args.target, "results": rows}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--diarizer", default="builtin:tiny-sortformer")
    p.add_argument("--setting", default=DEFAULT_SETTING, choices=list(MODEL_CARD_SETTINGS), help="diarizer latency setting")
    p.add_argument("--settings", default=None, help="several settings, comma-separated (overrides --setting)")
    p.add_argument("--batches", default="1,16,32")
    p.add_argument("--seconds", type=float, default=8.0, help="audio per stream")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before", action="store_true", help="also diarized runs without feature reuse (before/after)")
    p.add_argument("--before-masks", action="store_true",
                   help="also diarized runs with NeMo's pre-encoder forward, every row masked (before/after diarization/pre_encode.py)")
    p.add_argument("--before-shared", action="store_true",
                   help="also diarized runs on the diarizer's own features (before/after diarization/shared_features.py)")
    p.add_argument("--target", type=float, default=1.3, help="issue 50: diarized at most this x plain at the largest B")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = load_model(args.model)
    diarizer = load_benchmark_diarizer(args.diarizer)
    audio = synth_audio(args.seconds, 50).numpy()
    settings = args.settings.split(",") if args.settings else [args.setting]
    per_setting = [measure_setting(model, diarizer, setting, audio, args) for setting in settings]
    common = {**run_record(), "asr_model": model.name, "diarizer": args.diarizer,
              "diarizer_shares_asr_features": not feature_differences(model.preprocessor, diarizer.preprocessor), "audio_s_per_stream": args.seconds,
              "threads": 1, "target_ratio_at_largest_batch": args.target}  # fmt: skip
    if len(per_setting) == 1:  # the single-setting file's shape, as before
        write_json(args.out, {**common, **per_setting[0]})
    else:
        write_json(args.out, {**common, "settings": per_setting})


if __name__ == "__main__":
    main()
