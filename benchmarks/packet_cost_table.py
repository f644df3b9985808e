"""docs/performance.md's hand-over table (issue 48): benchmarks/packet_cost.py run with the branch
point and this tree side by side (--tree before=... --tree handover=.), every path through both
listeners, then /ws again in longer windows with Riva (unchanged) as the noise control; where the
hand-over tree's microseconds go (py-spy components) from the profiled run. Registered in
performance_page.py's TABLES as "packet-cost-handover"."""

from __future__ import annotations

from benchmarks.page_cpu import FAST_SUFFIX, PACKET_PATHS, PACKET_ROWS
from benchmarks.page_results import read, run_info, source

HANDOVER_FILES = ("packet_cost_handover_cpu.json", "packet_cost_handover_confirm_cpu.json")  # (profiled, longer)
TREES = ("before", "handover")  # packet_cost.py --tree labels: the branch point, this change
LISTENERS = (("", "uvicorn (--port)"), (FAST_SUFFIX, "picows (--fast-ws-port)"))


def _cell(row: dict) -> str:
    each = ", ".join(f"{r['us_per_packet_all_in']:.0f}" for r in row["repeats"])
    return f"{row['us_per_packet_all_in']:.0f} ({each})"


def _rows(d: dict) -> list[str]:
    trees = {t["tree"]: t["paths"] for t in d["runs"][0]["trees"]}
    target, run = d["target_us_per_packet"], f"{d['seconds']:g} s x {len(_any_row(trees)['repeats'])}"
    rows = []
    for path in PACKET_ROWS:
        for suffix, listener in LISTENERS:
            name = path + suffix
            if name not in trees[TREES[1]]:
                continue
            before, after = trees[TREES[0]][name], trees[TREES[1]][name]
            parts = list(after.get("profile", {}).get("by_component_us_per_packet", {}).items())[:3]
            us = after["us_per_packet_all_in"]
            verdict = "met" if us <= target else f"**missed** by {us - target:.0f} µs"
            rows.append(f"| {PACKET_PATHS.get(path, path)} | {listener if path[:4] != 'grpc' else 'grpc.aio'} | {run} "
                        f"| {_cell(before)} | {_cell(after)} | {before['us_per_packet_all_in'] / us:.2f}x "
                        f"| {', '.join(f'{k} {v:.0f}' for k, v in parts) or '-'} | {target} µs: {verdict} |")  # fmt: skip
    return rows


def _any_row(trees: dict) -> dict:
    return next(iter(trees[TREES[1]].values()))


def table_packet_cost_handover() -> str:
    runs = [read(name) for name in HANDOVER_FILES]
    rows = [f"| path ({runs[0]['streams_per_frontend']} paced streams, 1 front end) | listener | run (window x repeats) "
            "| before: µs per packet (repeats) | hand-over: µs per packet (repeats) | before / hand-over "
            "| largest parts, hand-over (µs per packet, py-spy) | target |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in runs:
        rows += _rows(d)
    return "\n".join(rows) + source(list(HANDOVER_FILES), [run_info(d) for d in runs])
