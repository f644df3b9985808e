"""The GPU run's last word: which CUDA defaults its results support switching, and why.

    python benchmarks/gpu/decide.py OUT        # reads OUT/results.jsonl (+ server_capacity.json)

run_gpu.sh runs it at the end (also after a phase timed out: it reads what was written). Each
candidate is a path that is the CPU's default but off on CUDA until a GPU checks it; its gates are
the ones benchmarks/gpu/README.md states, read from the records:

- exact paths (ring KV layout, our label loop): `--selftest` token-identical in every model and dtype
  run (demo and tiny-prompt, fp32 and bf16), the graph-vs-eager validation identical on the ring pool,
  and the candidate path's capacity not below the reference's (window layout, NeMo's computer) at
  any mode measured;
- fused epilogues (Triton; they reorder accumulation): token-identical on the trained demo model in
  fp32 and bf16, the random-weight model's agreement reported, and the capacity gate;
- SDPA attention: never the default (the faithful path stays); demo N/N in fp32 and bf16 makes it an
  option users are told about; agreement reported;
- the overlapped loop: `--selftest` N/N with it everywhere, and its capacity not below the same path
  without it at any mode measured.

A verdict is `switch` (every gate passed), `keep` (a gate failed: the reasons say which) or
`unresolved` (a gate was not measured, e.g. its phase ran out of time). The capacity of the
candidate path is measured with its switches together (--capacity-configs); where one of them
fails its own gate, the others' capacity gate is unresolved until a run measures them without it.
Diarization and the server phase are reported, not decided. OUT/decision.json holds it all.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REFERENCE = {"kv_layout": "window", "attention": "matmul", "decoder": "nemo", "epilogues": "nemo", "overlap": False}
EXACT = {"kv_layout": "ring", "attention": "matmul", "decoder": "label_loop", "epilogues": "nemo", "overlap": False}
CANDIDATES = [  # name, the switch, the selftest path that checks it, how strict its selftest gate is
    ("ring KV layout", {"NEMO_SERVE_KV_LAYOUT": "ring"}, EXACT, "exact"),
    ("our label loop", {"NEMO_SERVE_DECODER": "label_loop"}, EXACT, "exact"),
    ("fused epilogues", {"NEMO_SERVE_KERNELS": "fused"}, {**EXACT, "epilogues": "fused"}, "demo"),
    ("SDPA attention", {"NEMO_SERVE_ATTENTION": "sdpa"}, {**EXACT, "attention": "sdpa"}, "option"),
    ("overlapped loop", {"NEMO_SERVE_OVERLAP": "1"}, {**EXACT, "epilogues": "fused", "overlap": True}, "exact"),
]
PATH_KEYS = tuple(REFERENCE)
SWITCH_FIELD = {"NEMO_SERVE_KV_LAYOUT": "kv_layout", "NEMO_SERVE_DECODER": "decoder", "NEMO_SERVE_KERNELS": "epilogues",
                "NEMO_SERVE_ATTENTION": "attention", "NEMO_SERVE_OVERLAP": "overlap"}  # fmt: skip


def path_of(rec: dict) -> dict:
    return {k: rec.get(k) for k in PATH_KEYS}


def selftest_gate(records: list[dict], path: dict, strict: str) -> tuple[str, list[str], dict]:
    """(pass|fail|missing, reasons, agreement per model and dtype) for the selftest records of `path`."""
    runs = [r for r in records if r["kind"] == "selftest" and path_of(r) == path]
    agreement = {f"{r['model']} {r['dtype']}": (r.get("summary") or f"no summary (rc {r.get('rc')})") for r in runs}
    late = [f"{r['model']} {r['dtype']}" for r in runs if r.get("timed_out")]
    runs = [r for r in runs if not r.get("timed_out")]  # stopped at its time box: not measured
    needed = [r for r in runs if strict != "demo" and strict != "option" or r["model"] == "demo"]
    dtypes = {r["dtype"] for r in needed}
    if not needed or not {"fp32", "bf16"} <= dtypes or strict == "exact" and late:
        why = f"selftest not run in fp32 and bf16 for {path}" + (f" (timed out: {', '.join(late)})" if late else "")
        return "missing", [why], agreement
    failed = [f"{r['model']} {r['dtype']}: {r.get('summary') or 'rc ' + str(r.get('rc'))}" for r in needed if not r["passed"]]
    return ("fail" if failed else "pass"), [f"selftest not token-identical: {f}" for f in failed], agreement


def kept_up(records: list[dict], kind: str, path: dict) -> dict[int, int | None]:
    """Per mode (chunk ms): the most streams a level of `path` kept up (None: none did)."""
    out: dict[int, int | None] = {}
    for r in records:
        if r["kind"] == kind and path_of(r) == path:
            best = out.get(r["chunk_ms"])
            out[r["chunk_ms"]] = max(best or 0, r["streams"]) if r["keeps_up"] else best
    return out


def capacity_gate(records: list[dict], candidate: dict, reference: dict, every_mode: bool = True) -> tuple[str, list[str], dict]:
    """`candidate`'s kept-up streams not below `reference`'s at any mode both measured; a mode only one
    of them measured leaves it open, unless `every_mode` is False (the overlap phase measures some
    modes on purpose: then the reference's other modes do not count)."""
    cand, ref = kept_up(records, "capacity", candidate), kept_up(records, "capacity", reference)
    evidence = {"candidate": candidate, "reference": reference, "kept_up_by_chunk_ms": {
        ms: {"candidate": cand.get(ms), "reference": ref.get(ms)} for ms in sorted(set(cand) | set(ref))}}  # fmt: skip
    both = [ms for ms in cand if ms in ref]
    if not both:
        return "missing", ["capacity of the candidate and the reference not measured at a common mode"], evidence
    below = [f"{ms} ms: {cand[ms] or 0} < {ref[ms]} streams" for ms in both if (cand[ms] or 0) < (ref[ms] or 0)]
    missing = [f"{ms} ms measured for one path only" for ms in (evidence["kept_up_by_chunk_ms"] if every_mode else cand)
               if ms not in both]  # fmt: skip
    if below:
        return "fail", ["capacity below the reference's: " + "; ".join(below)], evidence
    return ("missing" if missing else "pass"), missing, evidence


def validate_gate(records: list[dict]) -> tuple[str, list[str]]:
    """Graph path against eager on the ring pool: every validate record after a ring `engine` record."""
    layout, seen, bad = None, 0, []
    for r in records:
        if r["kind"] == "engine":
            layout = r.get("kv_layout")
        elif r["kind"] == "validate" and layout == "ring":
            seen += 1
            if not r["ok"]:
                bad.append(f"{r['chunk_ms']} ms: graph vs eager {r['graph_vs_eager'].get('first_difference')}")
    if not seen:
        return "missing", ["graph vs eager not validated on the ring pool"]
    return ("fail" if bad else "pass"), [f"validate failed: {b}" for b in bad]


def candidate_path(records: list[dict], switch: dict) -> dict | None:
    """The measured capacity path (not the reference) that carries `switch`, without overlap unless
    the switch is the overlap: the first such in the run."""
    field, value = next(iter(switch.items()))
    want = _value(field, value)
    for r in records:
        if r["kind"] == "capacity" and (p := path_of(r)) != REFERENCE and p[SWITCH_FIELD[field]] == want:
            if field == "NEMO_SERVE_OVERLAP" or not p["overlap"]:
                return p
    return None


def decide(records: list[dict]) -> list[dict]:
    out = []
    for name, switch, path, strict in CANDIDATES:
        gates: dict[str, str] = {}
        reasons: list[str] = []
        gates["selftest"], why, agreement = selftest_gate(records, path, strict)
        reasons += why
        evidence: dict = {"agreement": agreement}
        if strict == "option":  # SDPA: the faithful path stays the default either way
            verdict = {"pass": "option", "fail": "keep", "missing": "unresolved"}[gates["selftest"]]
            out.append({"name": name, "switch": switch, "verdict": verdict, "gates": gates, "reasons": reasons, **evidence})
            continue
        if switch.get("NEMO_SERVE_KV_LAYOUT") == "ring":
            gates["validate"], why = validate_gate(records)
            reasons += why
        cand = candidate_path(records, switch)
        ref = {**cand, "overlap": False} if cand and switch.get("NEMO_SERVE_OVERLAP") else REFERENCE
        if cand is None:
            gates["capacity"], why, evidence["capacity"] = "missing", [f"no capacity run with {switch}"], None
        else:
            gates["capacity"], why, evidence["capacity"] = capacity_gate(records, cand, ref, ref is REFERENCE)
        reasons += why
        out.append({"name": name, "switch": switch, "gates": gates, "reasons": reasons, **evidence})
    _bundles(out)
    for c in out:
        if "verdict" not in c:
            g = c["gates"].values()
            c["verdict"] = "keep" if "fail" in g else "unresolved" if "missing" in g else "switch"
    return out


def _bundles(out: list[dict]) -> None:
    """A capacity pass measured together with a switch that failed its own selftest is unresolved."""
    failed = [(SWITCH_FIELD[k], _value(k, v)) for c in out if c["gates"].get("selftest") == "fail" for k, v in c["switch"].items()]
    for c in out:
        path = (c.get("capacity") or {}).get("candidate") or {}
        own = [(SWITCH_FIELD[k], _value(k, v)) for k, v in c["switch"].items()]
        bundled = [f"{f}={v}" for f, v in failed if (f, v) not in own and path.get(f) == v]
        if c["gates"].get("capacity") == "pass" and bundled:
            c["gates"]["capacity"] = "missing"
            c["reasons"].append(f"capacity measured only together with {', '.join(bundled)}, which failed its selftest")


def _value(env: str, value: str):
    """A switch's value as records spell it (overlap: a bool)."""
    return value == "1" if env == "NEMO_SERVE_OVERLAP" else value


def diarization_report(records: list[dict]) -> dict:
    """Streams kept up with diarization on per mode, beside the same path's plain capacity."""
    diar = [r for r in records if r["kind"] == "diar_capacity"]
    if not diar:
        return {"measured": False}
    path = path_of(diar[0])
    plain = kept_up(records, "capacity", path)
    kept = kept_up(records, "diar_capacity", path)
    return {"measured": True, "path": path, "diarizer": diar[0]["diarizer"], "setting": diar[0]["setting"],
            "kept_up_by_chunk_ms": {ms: {"diarized": kept[ms], "plain": plain.get(ms)} for ms in sorted(kept)}}  # fmt: skip


def server_report(out: Path) -> dict:
    path = out / "server_capacity.json"
    if not path.exists():
        return {"measured": False}
    s = json.loads(path.read_text())
    levels = [{"streams": lv["streams"], "listener": lv.get("listener", "uvicorn"), "verdict": lv["verdict"]}
              for lv in s.get("levels", [])]  # fmt: skip
    return {"measured": bool(levels), "frontends": s.get("frontends"), "levels": levels,
            "side_by_side": s.get("side_by_side"), "skipped": s.get("skipped")}  # fmt: skip


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    path = out / "results.jsonl"
    records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    result = {"candidates": decide(records), "diarization": diarization_report(records), "server": server_report(out)}
    (out / "decision.json").write_text(json.dumps(result, indent=1) + "\n")
    for c in result["candidates"]:
        env = " ".join(f"{k}={v}" for k, v in c["switch"].items())
        print(f"DECISION {c['name']} ({env}): {c['verdict'].upper()}" + (f" - {'; '.join(c['reasons'])}" if c["reasons"] else ""))
    print(f"DIARIZATION {json.dumps(result['diarization'].get('kept_up_by_chunk_ms'))}")
    print(f"SERVER {json.dumps(result['server'].get('levels'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
