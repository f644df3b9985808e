"""benchmarks/gpu/decide.py: each candidate's verdict (switch, keep, unresolved, option) from a finished
GPU run's records."""

from __future__ import annotations

import sys

from .helpers_gpu_run import REPO

sys.path.insert(0, str(REPO))


def _decision_records(fail_selftest=(), capacity=None, overlap_kept=2000) -> list[dict]:
    """A finished GPU run's records as gpu_bench.py writes them: every --selftest-configs path for the
    demo and tiny-prompt models in fp32 and bf16 (passed unless in `fail_selftest` as (epilogues,
    model, dtype)), validation on the ring pool, capacity per path and mode (kept-up levels)."""
    base = {"kv_layout": "ring", "attention": "matmul", "decoder": "label_loop", "epilogues": "nemo", "overlap": False}
    paths = [base, {**base, "kv_layout": "window", "decoder": "nemo"}, {**base, "attention": "sdpa"},
             {**base, "epilogues": "fused"}, {**base, "epilogues": "fused", "overlap": True}]
    recs = []
    for p in paths:
        for model in ("demo", "builtin:tiny-prompt"):
            for dtype in ("fp32", "bf16"):
                bad = (p["attention"] if p["attention"] == "sdpa" else p["epilogues"], model, dtype) in fail_selftest
                recs.append({"kind": "selftest", "model": model, "dtype": dtype, "passed": not bad, "rc": int(bad),
                             "summary": f"{3 if bad else 4}/4 token-identical", **p})
    for ms in (320, 80):
        recs += [{"kind": "engine", "kv_layout": "ring", "chunk_ms": ms}, {"kind": "validate", "ok": True, "chunk_ms": ms}]
    ref = {**base, "kv_layout": "window", "decoder": "nemo"}
    cand = {**base, "epilogues": "fused"}
    capacity = capacity or {80: (1000, 2000), 320: (2000, 4000)}
    for ms, (ref_kept, cand_kept) in capacity.items():
        for path, kept in ((ref, ref_kept), (cand, cand_kept)):
            recs += [{"kind": "capacity", "chunk_ms": ms, "streams": kept, "keeps_up": True, **path},
                     {"kind": "capacity", "chunk_ms": ms, "streams": 2 * kept, "keeps_up": False, **path}]
    if overlap_kept:
        recs.append({"kind": "capacity", "chunk_ms": 80, "streams": overlap_kept, "keeps_up": True, **cand, "overlap": True})
    return recs


def _verdicts(records) -> dict:
    from benchmarks.gpu.decide import decide

    return {c["name"]: c["verdict"] for c in decide(records)}


def test_decision_switches_what_every_gate_supports_and_sdpa_is_only_an_option():
    """Every selftest N/N (SDPA's random-weight bf16 run 3/4: agreement, reported), the ring pool
    validated, the candidate path at or above the reference at 80 and 320 ms, the overlap not below
    the same path without it: ring, our loop, fused and overlap switch; SDPA becomes an option."""
    from benchmarks.gpu.decide import decide

    recs = _decision_records(fail_selftest={("sdpa", "builtin:tiny-prompt", "bf16")})
    assert _verdicts(recs) == {"ring KV layout": "switch", "our label loop": "switch", "fused epilogues": "switch",
                               "SDPA attention": "option", "overlapped loop": "switch"}  # fmt: skip
    sdpa = next(c for c in decide(recs) if c["name"] == "SDPA attention")
    assert sdpa["agreement"]["builtin:tiny-prompt bf16"] == "3/4 token-identical"


def test_decision_keeps_a_path_whose_gate_failed_and_leaves_unmeasured_ones_open():
    """Seen to fail: without decide's _bundles, ring and our loop read `switch` while their capacity
    was measured only together with the fused epilogues that failed the demo model in bf16; with the
    capacity gate comparing the reference against itself, the 320 ms shortfall read `switch`."""
    fused_bad = _verdicts(_decision_records(fail_selftest={("fused", "demo", "bf16")}))
    assert fused_bad["fused epilogues"] == "keep"
    assert fused_bad["ring KV layout"] == fused_bad["our label loop"] == "unresolved"
    # random weights disagreeing under the fused kernels do not block them (agreement only)
    assert _verdicts(_decision_records(fail_selftest={("fused", "builtin:tiny-prompt", "fp32")}))["fused epilogues"] == "switch"
    slower = _verdicts(_decision_records(capacity={80: (1000, 2000), 320: (4000, 2000)}))
    assert slower["ring KV layout"] == slower["our label loop"] == slower["fused epilogues"] == "keep"
    no_overlap = _verdicts(_decision_records(overlap_kept=None))
    assert no_overlap["overlapped loop"] == "unresolved" and no_overlap["ring KV layout"] == "switch"
    late_overlap = _verdicts(_decision_records(overlap_kept=1000))
    assert late_overlap["overlapped loop"] == "keep"
    # graph vs eager differing on the ring pool keeps the ring layout (only it)
    bad_graph = _decision_records()
    next(r for r in bad_graph if r["kind"] == "validate").update(ok=False, graph_vs_eager={"first_difference": "step 3"})
    bad_graph_v = _verdicts(bad_graph)
    assert bad_graph_v["ring KV layout"] == "keep" and bad_graph_v["fused epilogues"] == "switch", bad_graph_v
    # a mode only the reference measured leaves the candidate open (the overlap phase's 80 ms alone does not)
    cand_320 = {"kind": "capacity", "chunk_ms": 320, "epilogues": "fused"}
    ref_only = [r for r in _decision_records() if any(r.get(k) != v for k, v in cand_320.items())]
    ref_only_v = _verdicts(ref_only)
    assert ref_only_v["fused epilogues"] == ref_only_v["ring KV layout"] == "unresolved", ref_only_v
    assert ref_only_v["overlapped loop"] == "switch", ref_only_v


def test_decision_reads_a_selftest_stopped_at_its_time_box_as_not_measured():
    """A selftest killed at the end of its box (timed_out) leaves its path unresolved, not kept: the
    demo model's fused bf16 run and the tiny-prompt's ring bf16 run. Seen to fail (`keep`) before
    gpu_bench recorded timed_out and decide set such runs aside."""
    recs = _decision_records()
    for r in recs:
        if r["kind"] == "selftest" and r["dtype"] == "bf16" and (
                r["epilogues"] == "fused" and not r["overlap"] and r["model"] == "demo"
                or r["epilogues"] == "nemo" and r["kv_layout"] == "ring" and r["attention"] == "matmul"
                and r["model"] != "demo"):  # fmt: skip
            r.update(passed=False, rc=-9, summary=None, timed_out=True)
    v = _verdicts(recs)
    assert v["fused epilogues"] == v["ring KV layout"] == v["our label loop"] == "unresolved", v
    assert v["SDPA attention"] == "option" and v["overlapped loop"] == "switch", v  # its own runs all finished
