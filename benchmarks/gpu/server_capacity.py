"""Issue 46 step 7: capacity through the real server on the GPU, beside the engine-core-only figure.

    python benchmarks/gpu/server_capacity.py --out OUT [--mode 0] [--levels 1000,2000] [--budget-s 120]

Run by benchmarks/gpu/run_gpu.sh after gpu_bench.py when SERVER_LOAD=1. It reads OUT/results.jsonl
(the bench's records) for the same settings as the engine-core capacity run: the model's random init
(benchmarks/architecture.construct, seed 0) with the mode's calibrated blank bias and the capped
max_symbols (a trained model's decoder load), the dtype, and the capacity levels of the mode. It
saves that model as a .nemo, starts `nemo-serve` on it (front ends, sockets, the engine core; the
sweep's Server), and drives it with the multi-process load generator (benchmarks/load_workers.py)
at each level: the highest level the engine core alone kept up and the next one, each only if it
fits in --budget-s. OUT/server_capacity.json is rewritten after every level (a killed run keeps
what it measured): the server's levels (partial/final latency, drift, verdict, the generator's own
lateness per worker, the server's CPU cores) and the engine-only records of the same mode, side by
side. Without the bench's records (or on CPU) the model is served uncalibrated and the JSON says so.
Tokens are not compared with NeMo's loop here (the oracle on a 0.6B model would cost the budget):
the bench's selftest phase checks parity and tests/test_loadgen.py checks tokens through the
generator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks.load_items import make_items  # noqa: E402
from benchmarks.load_level import default_client  # noqa: E402
from benchmarks.load_summary import format_level  # noqa: E402
from benchmarks.load_workers import DEFAULT_MAX_SEND_LATENESS_MS, lateness_line, measure_level  # noqa: E402

T0 = time.time()
LEVEL_TAIL_S = 15.0  # after --level-seconds: the longest item in flight, its final, the server's metrics


def bench_records(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def same_settings(records: list[dict], mode: int) -> dict:
    """The engine-core run's calibration, max_symbols and capacity records of one mode."""
    model = next((r for r in records if r["kind"] == "model"), None)
    return {
        "calibration": next((r for r in records if r["kind"] == "calibration" and r["context_right"] == mode), None),
        "max_symbols": model["max_symbols"] if model else None,
        "engine_only": [r for r in records if r["kind"] == "capacity" and r["context_right"] == mode],
    }


def choose_levels(engine_only: list[dict], given: str | None) -> list[int]:
    """--levels, else the highest level the engine core kept up and the first one it did not."""
    if given:
        return [int(x) for x in given.split(",")]
    kept = [r["streams"] for r in engine_only if r["keeps_up"]]
    behind = [r["streams"] for r in engine_only if not r["keeps_up"]]
    levels = ([max(kept)] if kept else []) + ([min(b for b in behind if not kept or b > max(kept))] if behind else [])
    return levels or [1000]


def served_file(args, settings: dict) -> Path:
    """The bench's model as a .nemo: random init, the mode's blank bias added, max_symbols capped."""
    import torch
    from omegaconf import open_dict

    from benchmarks.architecture import construct

    nemo = construct.__wrapped__(args.model)  # a fresh copy: construct's cached model stays as built
    cal = settings["calibration"]
    with torch.no_grad():
        nemo.joint.joint_net[-1].bias[nemo.decoder.blank_idx] += cal["blank_bias_added"] if cal else 0.0
    if settings["max_symbols"]:
        with open_dict(nemo.cfg):
            nemo.cfg.decoding.greedy.max_symbols = settings["max_symbols"]  # the server's loader keeps it
    path = Path(args.work_dir) / f"{args.model}-r{args.mode}.nemo"
    path.parent.mkdir(parents=True, exist_ok=True)
    nemo.save_to(str(path))
    return path


def start_server(args, nemo_path: Path, num_slots: int):
    """The sweep's Server, plus a picows listener on its own port with --fast-ws (fast_ws_port set)."""
    from benchmarks.server_process import free_port
    from benchmarks.sweep import Server

    class WithFastWs(Server):
        def _start(self, cmd, env, spec, log_path) -> None:
            super()._start(cmd + (["--fast-ws-port", str(spec.fast_ws_port)] if spec.fast_ws_port else []), env, spec, log_path)

    spec = types.SimpleNamespace(context_right=args.mode, dtype=args.dtype, device=args.device, threads=args.threads,
                                 frontends=args.frontends, devices=None, ray=False,
                                 fast_ws_port=free_port() if args.fast_ws else None)  # fmt: skip
    server = WithFastWs(spec, nemo_path, num_slots, Path(args.out) / "server_capacity.server.log")
    server.fast_ws_port = spec.fast_ws_port
    return server, server.wait_ready(max(30.0, left(args) - 20))


def listeners(server) -> list[tuple[str, str]]:
    """(name, /ws url) of each listener to drive: uvicorn's, then picows's when the server has one."""
    out = [("uvicorn", server.url.replace("http", "ws") + "/ws")]
    if server.fast_ws_port:
        out.append(("picows", f"ws://127.0.0.1:{server.fast_ws_port}/ws"))
    return out


def left(args) -> float:
    return args.budget_s - (time.time() - T0)


def side_by_side(levels: list[dict], engine_only: list[dict]) -> list[dict]:
    engine = {r["streams"]: r for r in engine_only}
    return [{"streams": lv["streams"], "server_verdict": lv["verdict"],
             "server_partial_p95_ms": lv["partial_latency_ms"]["p95"],
             "engine_keeps_up": engine[lv["streams"]]["keeps_up"] if lv["streams"] in engine else None,
             "engine_lateness_p95_ms": engine[lv["streams"]]["lateness_p95_ms"] if lv["streams"] in engine else None}
            for lv in levels if lv["listener"] == "uvicorn"]  # fmt: skip


def listener_side_by_side(levels: list[dict]) -> list[dict]:
    """Per level driven through picows: its verdict and partial p95 beside uvicorn's at that level."""
    by = {(lv["listener"], lv["streams"]): lv for lv in levels}
    return [{"streams": n, **{f"{name}_{k}": (by[(name, n)][f] if (name, n) in by else None)
                               for name in ("uvicorn", "picows") for k, f in (("verdict", "verdict"), ("cpu_cores", "server_cpu_cores"))},
             "uvicorn_partial_p95_ms": by[("uvicorn", n)]["partial_latency_ms"]["p95"] if ("uvicorn", n) in by else None,
             "picows_partial_p95_ms": by[("picows", n)]["partial_latency_ms"]["p95"]}
            for (name, n) in by if name == "picows"]  # fmt: skip


def run(args) -> dict:
    global T0
    T0 = time.time()  # the budget counts from the run, not from the import (a test suite imports it early)
    out = Path(args.out)
    settings = same_settings(bench_records(out), args.mode)
    levels = choose_levels(settings["engine_only"], args.levels)
    result = {"benchmark": "gpu_server_capacity", **run_record(), "run_command": os.environ.get("NEMO_SERVE_RUN_COMMAND"),
              "model": args.model, "context_right": args.mode, "dtype": args.dtype, "device": args.device,
              "calibrated": settings["calibration"] is not None, "calibration": settings["calibration"],
              "max_symbols": settings["max_symbols"], "workers": args.workers, "frontends": args.frontends,
              "level_seconds": args.level_seconds, "planned_levels": levels, "levels": [], "skipped": [],
              "core_io_threads": os.environ.get("NEMO_SERVE_CORE_IO_THREADS", "1"),
              "engine_only": settings["engine_only"]}  # fmt: skip
    path = out / "server_capacity.json"
    t = time.time()
    nemo_path = served_file(args, settings)
    result["model_saved_s"] = round(time.time() - t, 1)
    items = make_items("synth", args.items, tuple(float(x) for x in args.item_seconds.split(",")))
    server, ready = start_server(args, nemo_path, max(levels) + max(2, max(levels) // 10))
    result.update(server_ready_s=round(time.time() - T0, 1), chunk_ms=ready.get("chunk_ms"),
                  server_command=" ".join(server.command))  # fmt: skip
    write_json(path, result)
    try:
        for n, (listener, url) in planned(levels, listeners(server)):
            if left(args) < args.level_seconds + LEVEL_TAIL_S:
                result["skipped"].append({"streams": n, "listener": listener, "why": "budget", "left_s": round(left(args), 1)})
                continue
            level = {"listener": listener, **one_level(args, url, server, items, n)}
            result["levels"].append(level)
            result["side_by_side"] = side_by_side(result["levels"], settings["engine_only"])
            if listener != "uvicorn":
                result["listeners_side_by_side"] = listener_side_by_side(result["levels"])
            write_json(path, result)
    finally:
        server.stop()
    result["seconds"] = round(time.time() - T0, 1)
    write_json(path, result)
    return result


def planned(levels: list[int], lines: list[tuple[str, str]]) -> list[tuple[int, tuple[str, str]]]:
    """Each level through every listener in turn (uvicorn, then picows), so that a budget cut after
    the first level still leaves the two side by side at one level."""
    return [(n, line) for n in levels for line in lines]


def one_level(args, url: str, server, items, n: int) -> dict:
    from benchmarks.process_sampler import Sampler

    sampler = Sampler(server.proc.pid)
    sampler.start()
    t0 = time.time()
    level, _ = measure_level(url, items, n, args.level_seconds,
                             ramp_s=args.ramp_s, num_workers=args.workers, context_right=args.mode,
                             max_send_lateness_ms=args.max_send_lateness_ms,
                             client=default_client())  # the cheaper client where installed: 5,000 streams on 16 cores  # fmt: skip
    level["client"] = default_client()
    level.update(sampler.window(t0, time.time()))
    sampler.stop()
    print(format_level(level), flush=True)
    print(lateness_line(level), flush=True)
    return level


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the GPU run's folder (its results.jsonl is read)")
    ap.add_argument("--model", default="nemotron-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--mode", type=int, default=0, help="right context (0: 80 ms, where the engine kept up 1,000)")
    ap.add_argument("--levels", default=None, help="comma-separated streams (default: from the engine-only records)")
    ap.add_argument("--level-seconds", type=float, default=10.0)
    ap.add_argument("--ramp-s", type=float, default=2.0)
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--item-seconds", default="4,8", help="short items: a level ends when its last item does")
    ap.add_argument("--workers", type=int, default=6, help="load generator processes (16 cores: 6 + 6 front ends + core)")
    ap.add_argument("--frontends", type=int, default=6)
    ap.add_argument("--threads", type=int, default=4, help="the server's OMP/MKL threads (as gpu_bench's --threads)")
    ap.add_argument("--max-send-lateness-ms", type=float, default=DEFAULT_MAX_SEND_LATENESS_MS)
    ap.add_argument("--work-dir", default="/tmp/nemo-serve-server-capacity", help="where the .nemo is saved")
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--fast-ws", action="store_true",
                    help="also serve --fast-ws-port (picows) and drive the highest level through it")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    result = run(parse(argv))
    return 0 if result["levels"] else 5


if __name__ == "__main__":
    sys.exit(main())
