"""Where a diarized run's time goes, at each latency setting: the diarizer's parts, inherent or not.

    nice -n 5 python benchmarks/diar_step_profile.py --out benchmarks/results/diar_step_profile_cpu.json

The run of benchmarks/diarization_cost.py (B diarized streams of the same audio in the in-process
engine, one thread), with the diarizer's pieces wrapped in timers (perf_counter, no profiler: the
split) and then once more under torch.profiler (the top operators inside the diarizer's encoder
and Transformer, with its overhead). Parts:

- inherent, NeMo's arithmetic on [cache | FIFO | chunk]: the pre-encoder over the chunk, the
  FastConformer layers, the encoder projection, the Transformer layers;
- everything else: features, batch staging (padding to one width), the step's plan, the model
  input's assembly, positional encodings and masks, speaker head (linear + sigmoid) and pred mask,
  the update, collect (the host copy, per-row Python), the speaker attacher.

Also each diarizer step's padded width against its rows' own lengths (what grouping rows by width
could save: nothing when every row has the same fill).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks.diarization_cost import timed_run  # noqa: E402
from nemo_serve.diarization import runner as diar_runner  # noqa: E402
from nemo_serve.diarization import step as diar_step  # noqa: E402
from nemo_serve.diarization.load import load_diarizer  # noqa: E402
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings  # noqa: E402
from nemo_serve.engine import speakers  # noqa: E402
from nemo_serve.model import load_model  # noqa: E402
from nemo_serve.synth import synth_audio  # noqa: E402

INHERENT = ("pre_encode", "encoder.layers", "encoder.proj", "transformer.layers")


class Timers:
    """Seconds per label; a label's time includes the labels called inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.widths: list[tuple[int, int]] = []  # per diarizer step: (rows x padded width, sum of row lengths)

    def wrap(self, owner, attr: str, label: str, stack: ExitStack) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            with torch.profiler.record_function(label):
                out = original(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - started
            return out

        setattr(owner, attr, timed)
        stack.callback(setattr, owner, attr, original)


def instrument(diarizer, timers: Timers, stack: ExitStack) -> None:
    enc, modules = diarizer.encoder, diarizer.sortformer_modules
    w = timers.wrap
    w(diar_runner.SortformerRunner, "plan", "plan", stack)  # the chunks' cuts and features
    w(diar_runner.SortformerRunner, "_chunk_features", "features", stack)
    w(diar_runner, "make_batch", "make_batch", stack)
    w(diar_runner, "plan_step", "plan_step", stack)
    w(diar_runner.SortformerRunner, "collect", "collect", stack)
    w(diar_runner.SortformerRunner, "launch", "launch", stack)
    w(diar_step, "pre_encode", "pre_encode", stack)  # diarization/pre_encode.py (NeMo's forward inside, or its layers)
    w(diar_step, "model_input", "model_input", stack)
    w(diarizer, "frontend_encoder", "encoder", stack)
    w(enc.pos_enc, "forward", "encoder.pos_enc", stack)
    w(enc, "_create_masks", "encoder.masks", stack)
    for layer in enc.layers:
        w(layer, "forward", "encoder.layers", stack)
    if modules.encoder_proj is not None:
        w(modules.encoder_proj, "forward", "encoder.proj", stack)
    w(diarizer, "forward_infer", "transformer", stack)
    w(diarizer.transformer_encoder, "forward", "transformer.layers", stack)
    w(modules, "forward_speaker_sigmoids", "speaker_head", stack)
    w(modules, "apply_mask_to_preds", "mask_preds", stack)
    w(diar_step, "update_slots", "update", stack)
    w(speakers.SpeakerAttacher, "publish", "speakers.publish", stack)
    original_input = diar_step.model_input

    def model_input(pool, slots, cache_lens, fifo_lens, chunk, width):
        lengths = cache_lens + fifo_lens + chunk.lengths
        timers.widths.append((len(lengths) * width, int(lengths.sum())))
        return original_input(pool, slots, cache_lens, fifo_lens, chunk, width)

    diar_step.model_input = model_input
    stack.callback(setattr, diar_step, "model_input", original_input)


def split(timers: Timers, run: dict) -> dict:
    s = timers.seconds
    inherent = sum(s[k] for k in INHERENT)
    diarizer = run["diarizer_seconds"]  # the runner's plan, launch (the step) and collect
    padded, valid = map(sum, zip(*timers.widths)) if timers.widths else (0, 0)
    return {"run_seconds": round(run["seconds"], 4), "asr_steps": run["asr_steps"], "diarizer_steps": run["diarizer_steps"],
            "diarizer_seconds": round(diarizer, 4), "inherent_seconds": round(inherent, 4),
            "other_diarizer_seconds": round(diarizer - inherent, 4),
            "speaker_attacher_seconds": round(s["speakers.publish"], 4),
            "inherent_share_of_diarizer": round(inherent / max(diarizer, 1e-9), 3),
            "padded_frames_valid_share": round(valid / max(padded, 1), 3),
            "parts_seconds": {k: round(v, 4) for k, v in sorted(s.items())}}  # fmt: skip


def profile_setting(model, diarizer, setting: str, audio, args) -> dict:
    apply_settings(diarizer, MODEL_CARD_SETTINGS[setting])
    timed_run(model, diarizer, args.batch, audio, True)  # warm-up
    plain = [timed_run(model, diarizer, args.batch, audio, False)["seconds"] for _ in range(args.repeats)]
    splits = []
    for _ in range(args.repeats):
        timers = Timers()
        with ExitStack() as stack:
            instrument(diarizer, timers, stack)
            splits.append(split(timers, timed_run(model, diarizer, args.batch, audio, True)))
    best = min(splits, key=lambda r: r["run_seconds"])  # the least disturbed run on a shared machine
    with ExitStack() as stack, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        instrument(diarizer, Timers(), stack)
        timed_run(model, diarizer, args.batch, audio, True)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [{"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count} for e in ops[:25]]
    row = {"diarizer_setting": setting, "batch": args.batch, "plain_run_seconds_median": round(statistics.median(plain), 4),
           "least_disturbed": best, "runs": splits, "torch_profiler_top_ops_by_self_cpu": top}  # fmt: skip
    print(f"{setting}: plain {row['plain_run_seconds_median']} s, diarized {best['run_seconds']} s, diarizer "
          f"{best['diarizer_seconds']} s of which inherent {best['inherent_seconds']} s", flush=True)  # fmt: skip
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--diarizer", default="builtin:tiny-sortformer")
    p.add_argument("--settings", default="very_high,high,low,ultra_low")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=8.0, help="audio per stream")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model, diarizer = load_model(args.model), load_diarizer(args.diarizer)
    audio = synth_audio(args.seconds, 50).numpy()
    rows = [profile_setting(model, diarizer, s, audio, args) for s in args.settings.split(",")]
    write_json(args.out, {**run_record(), "asr_model": model.name, "diarizer": args.diarizer,
                          "audio_s_per_stream": args.seconds, "threads": 1, "inherent_parts": list(INHERENT),
                          "settings": rows})  # fmt: skip


if __name__ == "__main__":
    main()
