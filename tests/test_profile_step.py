"""benchmarks/gpu/profile_step.py, the profile run_gpu.sh runs first on a GPU: its CPU dry run on a
tiny model writes every key the GPU run writes, with what needs CUDA null."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def test_profile_step_dry_run_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_SERVE_DECODER", "nemo")  # the profile's ranges are NeMo's loop's (CUDA's default decoder)
    import nemo_serve.engine.encoder as enc_mod
    import nemo_serve.engine.step as step_mod
    from benchmarks.gpu import profile_step
    from benchmarks.gpu.emission import TRAINED
    from benchmarks.gpu.step_ranges import RANGES

    originals = (step_mod.apply_prompt, enc_mod.attention_masks)
    rc = profile_step.main(["--out", str(tmp_path), "--model", "tiny-prompt", "--device", "cpu", "--dtype", "fp32",
                            "--modes", "0,13", "--rows", "4,8", "--profile-rows", "8", "--steps", "3",
                            "--index-slots", "64", "--index-rows", "16", "--big-rows", "16", "--big-part", "4",
                            "--big-modes", "0", "--steps-big", "2", "--threads", "1", "--budget-s", "100"])  # fmt: skip
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert rc == 0 and doc["errors"] == [] and doc["skipped"] == [], doc["errors"]
    assert set(doc) == {"env", "timer", "calibration", "split", "fit", "kernels", "index", "big", "skipped", "errors",
                        "seconds"} and doc["timer"] == "wall_clock"  # fmt: skip
    assert all(abs(c["measured"] - TRAINED["tokens_per_frame"]) <= 0.03 for c in doc["calibration"]), doc["calibration"]
    # 1. encoder against decoder per (mode, rows), with every step's trips and a fit per row count
    assert [(s["chunk_ms"], s["rows"]) for s in doc["split"]] == [(80, 4), (80, 8), (1120, 4), (1120, 8)]
    for s in doc["split"]:
        assert s["steps"] == 3 and len(s["per_step"]) == 3 and s["decoder_ms"] > 0 and s["encoder_ms"] > 0, s
        assert all(p["step_ms"] > p["decoder_ms"] > 0 for p in s["per_step"]), s  # the decoder is inside the step
        assert all(p["outer"] >= 1 for p in s["per_step"]) and s["label_loop"]["device_steps"] == 3, s
    assert set(doc["fit"]) == {"4", "8"}
    # 2. one profiled step per (mode, rows): every range ran; what needs CUDA is null on CPU
    assert [(k["chunk_ms"], k["rows"]) for k in doc["kernels"]] == [(80, 8), (1120, 8)]
    for k in doc["kernels"]:
        assert list(k["ranges"]) == list(RANGES)
        assert all(r["calls"] > 0 and r["cpu_ms"] > 0 and r["gpu_ms"] is None for r in k["ranges"].values()), k["ranges"]
        assert k["ranges"]["joint"]["calls"] > k["ranges"]["prediction network"]["calls"]  # inner iterations
        assert k["gpu_ms_total"] is None and k["top_kernels"] is None and k["index_kernels"] is None and k["top_ops"]
    assert (tmp_path / doc["kernels"][0]["trace"]).stat().st_size > 1000
    assert (step_mod.apply_prompt, enc_mod.attention_masks) == originals  # the ranges are gone afterwards
    # 3. index kernels' GB/s; 4. one big step against parts
    ix = doc["index"]
    assert ix["rows"] == 16 and not ix["over_2_31"] and all(ix[k] > 0 for k in ix if k.endswith("_gbs")), ix
    (b,) = doc["big"]
    assert (b["rows"], b["part_rows"]) == (16, 4) and b["one_step_ms"] > 0 and b["parts_ms"] > 0, b
    text = (tmp_path / "summary.txt").read_text()
    assert "80 ms x    8 rows: step" in text and "decoder bookkeeping" in text and "errors: []" in text


def test_ranges_attribute_each_kernel_to_the_innermost_range():
    """The CUDA branch of step_ranges.analyse, on a profile tree made by hand (no GPU here): a range's
    GPU time and kernels are those of its own ops, not of ranges nested in it; top kernels and the
    index kernels count every kernel once."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    from benchmarks.gpu.step_ranges import PREFIX, analyse

    def ev(name, cpu_us, kernels=(), children=()):
        return NS(name=name, device_type=DeviceType.CPU, cpu_time_total=cpu_us, cpu_children=list(children),
                  kernels=[Kernel(k, 0, d) for k, d in kernels])  # fmt: skip

    joint = ev(PREFIX + "joint", 30, children=[ev("aten::addmm", 25, [("gemm", 400.0)])])
    gather = ev(PREFIX + "cache gather", 10, children=[ev("aten::index_select", 8, [("indexSelectLargeIndex", 200.0)])])
    decode = ev(PREFIX + "decoder bookkeeping", 100,
                children=[gather, ev("aten::where", 5, [("where_kernel", 10.0)]), joint,
                          ev("aten::any", 4, [("reduce_kernel", 5.0), ("reduce_kernel", 5.0)])])  # fmt: skip
    flat = [decode, *decode.cpu_children, gather.cpu_children[0], joint.cpu_children[0],
            NS(name="gemm", device_type=DeviceType.CUDA, cpu_children=[], kernels=[])]  # fmt: skip
    prof = NS(events=lambda: flat, key_averages=lambda: [NS(key="aten::addmm", count=1, self_cpu_time_total=25)])
    out = analyse(prof, cuda=True)
    r = out["ranges"]
    assert r["decoder bookkeeping"] == {"calls": 1, "cpu_ms": 0.06, "gpu_ms": 0.02, "kernels": 3}, r
    assert r["joint"] == {"calls": 1, "cpu_ms": 0.03, "gpu_ms": 0.4, "kernels": 1}
    assert r["cache gather"]["gpu_ms"] == 0.2 and r["attention"] == {"calls": 0, "cpu_ms": 0.0, "gpu_ms": 0.0, "kernels": 0}
    assert out["gpu_ms_total"] == 0.62 and out["kernels_total"] == 5
    assert out["top_kernels"][0] == {"name": "gemm", "calls": 1, "total_us": 400.0, "mean_us": 400.0}
    assert out["top_kernels"][-1]["name"] == "reduce_kernel" and out["top_kernels"][-1]["calls"] == 2
    assert out["index_kernels"] == {"calls": 1, "total_us": 200.0, "names": ["indexSelectLargeIndex"]}
