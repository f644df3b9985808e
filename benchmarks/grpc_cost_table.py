"""docs/performance.md's tables for the Riva door on our own HTTP/2 (--fast-grpc-port, issue 48):
the gRPC layer alone, candidate by candidate (benchmarks/grpc_layer_bench.py, "grpc-layer"), and
the whole front end per paced packet through both Riva doors beside picows's /ws in one server
(benchmarks/packet_cost.py --fast-ws --fast-grpc, "packet-cost-fastgrpc"). Registered in
performance_page.py's TABLES."""

from __future__ import annotations

from benchmarks.page_results import read, run_info, source

LAYER_FILE = "grpc_layer_cpu.json"
FASTGRPC_FILE = "packet_cost_fastgrpc_cpu.json"
LAYER_NAMES = {"grpc_aio": "grpc.aio (--grpc-port)", "grpclib": "grpclib (pure Python, on h2)",
               "fast_grpc": "our HTTP/2 on an asyncio Protocol (--fast-grpc-port)"}  # fmt: skip
DOORS = (  # packet_cost.py path -> (what, listener)
    ("grpc_20ms", "Riva StreamingRecognize, 20 ms", "grpc.aio (--grpc-port)"),
    ("grpc_20ms_fastgrpc", "Riva StreamingRecognize, 20 ms", "our HTTP/2 (--fast-grpc-port)"),
    ("ws_s16_20ms_fast", "/ws, 20 ms PCM16 (for comparison)", "picows (--fast-ws-port)"),
)


def table_grpc_layer() -> str:
    d = read(LAYER_FILE)
    rows = [f"| gRPC server ({d['streams']} paced streams, {d['packet_ms']:g} ms packets, same trivial StreamingRecognize) "
            "| µs per packet (median) | repeats |", "|---|---|---|"]  # fmt: skip
    for name, c in sorted(d["candidates"].items(), key=lambda kv: kv[1]["us_per_packet_median"]):
        each = ", ".join(f"{r['us_per_packet']:.1f}" for r in c["repeats"])
        rows.append(f"| {LAYER_NAMES.get(name, name)} | {c['us_per_packet_median']:.1f} | {each} |")
    return "\n".join(rows) + source([LAYER_FILE], [run_info(d)])


def table_packet_cost_fastgrpc() -> str:
    d = read(FASTGRPC_FILE)
    paths = d["runs"][0]["trees"][0]["paths"]
    target = d["target_us_per_packet"]
    rows = [f"| path ({d['streams_per_frontend']} paced streams, 1 front end) | listener | run (window x repeats) "
            "| µs per packet (repeats) | result messages per packet | largest parts (µs per packet, py-spy) | target |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for path, what, listener in DOORS:
        row = paths[path]
        us = row["us_per_packet_all_in"]
        each = ", ".join(f"{r['us_per_packet_all_in']:.0f}" for r in row["repeats"])
        per_result = sorted(r["results_per_packet"] for r in row["repeats"])[len(row["repeats"]) // 2]
        parts = list(row.get("profile", {}).get("by_component_us_per_packet", {}).items())[:3]
        verdict = "met" if us <= target else f"**missed** by {us - target:.0f} µs"
        rows.append(f"| {what} | {listener} | {d['seconds']:g} s x {len(row['repeats'])} | {us:.0f} ({each}) "
                    f"| {per_result:.2f} | {', '.join(f'{k} {v:.0f}' for k, v in parts) or '-'} | {target} µs: {verdict} |")  # fmt: skip
    return "\n".join(rows) + source([FASTGRPC_FILE], [run_info(d)])


BLAST_GRPC_FILE = "packet_cost_streams_blast_grpc_cpu.json"  # packet_cost_streams.py --client blast, gRPC paths
BLAST_GRPC_PATHS = {
    "ws_picows": "/ws, 20 ms float32 frames, picows (--fast-ws-port), for comparison",
    "grpc_fastgrpc": "Riva StreamingRecognize, 20 ms PCM16, our HTTP/2 (--fast-grpc-port)",
    "grpc_aio": "Riva StreamingRecognize, 20 ms PCM16, grpc.aio (--grpc-port)",
}


def table_packet_cost_streams_blast_grpc() -> str:
    """The blast sender's gRPC mode (blast_grpc.py) beside /ws at the same levels: each run's cell
    as packet_cost_table's blast table writes it, and words identical to /ws's per path."""
    from benchmarks.packet_cost_table import _blast_cell, _first_met

    d = read(BLAST_GRPC_FILE)
    target, levels = d["target_us_per_packet"], sorted({r["streams"] for r in d["rows"]})
    out = ["| path (1 front end, pinned, paced 20 ms packets, blast sender) | " + " | ".join(f"{n:,} streams" for n in levels)
           + " | streams whose finals equal /ws's | target |", "|---|" + "---|" * len(levels) + "---|---|"]  # fmt: skip
    for path, name in BLAST_GRPC_PATHS.items():
        mine = [r for r in d["rows"] if r["path"] == path]
        if not mine:
            continue
        cells = ["; ".join(_blast_cell(r) for r in mine if r["streams"] == n) or "-" for n in levels]
        same = ", ".join(f"{r['quality'].get('token_identical_streams', '-')}/{r['quality'].get('streams_compared', '-')}"
                         for r in mine if r.get("quality"))  # fmt: skip
        out.append(f"| {name} | " + " | ".join(cells) + f" | {same or '-'} | {target} µs: {_first_met(mine, target)} |")
    return "\n".join(out) + source([BLAST_GRPC_FILE], [run_info(d)])
