"""docs/performance.md's hand-over table (issue 48): benchmarks/packet_cost.py run with the branch
point and this tree side by side (--tree before=... --tree handover=.), every path through both
listeners, then /ws again in longer windows with Riva (unchanged) as the noise control; where the
hand-over tree's microseconds go (py-spy components) from the profiled run. Registered in
performance_page.py's TABLES as "packet-cost-handover". And the decode and ring-write table
("packet-cost-decode"): benchmarks/packet_path_bench.py's in-process parts over packet_cost.py's
side-by-side run of the same change. And uvicorn's frame parsing ("packet-cost-uvicorn-frames"):
packet_cost.py with the branch point and the tree that parses whole data frames itself."""

from __future__ import annotations

import statistics

from benchmarks.page_cpu import FAST_SUFFIX, PACKET_PATHS, PACKET_ROWS
from benchmarks import page_results
from benchmarks.page_results import read, run_info, source

HANDOVER_FILES = ("packet_cost_handover_cpu.json", "packet_cost_handover_confirm_cpu.json")  # (profiled, longer)
TREES = ("before", "handover")  # packet_cost.py --tree labels: the branch point, this change
LISTENERS = (("", "uvicorn (--port)"), (FAST_SUFFIX, "picows (--fast-ws-port)"))


def _cell(row: dict) -> str:
    each = ", ".join(f"{r['us_per_packet_all_in']:.0f}" for r in row["repeats"])
    return f"{row['us_per_packet_all_in']:.0f} ({each})"


def _rows(d: dict, labels: tuple[str, str] = TREES, paths: tuple[str, ...] = PACKET_ROWS) -> list[str]:
    trees = {t["tree"]: t["paths"] for t in d["runs"][0]["trees"]}
    target, run = d["target_us_per_packet"], f"{d['seconds']:g} s x {len(_any_row(trees[labels[1]])['repeats'])}"
    rows = []
    for path in paths:
        for suffix, listener in LISTENERS:
            name = path + suffix
            if name not in trees[labels[1]]:
                continue
            before, after = trees[labels[0]][name], trees[labels[1]][name]
            parts = list(after.get("profile", {}).get("by_component_us_per_packet", {}).items())[:3]
            us = after["us_per_packet_all_in"]
            verdict = "met" if us <= target else f"**missed** by {us - target:.0f} µs"
            rows.append(f"| {PACKET_PATHS.get(path, path)} | {listener if path[:4] != 'grpc' else 'grpc.aio'} | {run} "
                        f"| {_cell(before)} | {_cell(after)} | {before['us_per_packet_all_in'] / us:.2f}x "
                        f"| {', '.join(f'{k} {v:.0f}' for k, v in parts) or '-'} | {target} µs: {verdict} |")  # fmt: skip
    return rows


def _any_row(trees: dict) -> dict:
    return next(iter(trees.values()))


def table_packet_cost_handover() -> str:
    runs = [read(name) for name in HANDOVER_FILES]
    rows = [f"| path ({runs[0]['streams_per_frontend']} paced streams, 1 front end) | listener | run (window x repeats) "
            "| before: µs per packet (repeats) | hand-over: µs per packet (repeats) | before / hand-over "
            "| largest parts, hand-over (µs per packet, py-spy) | target |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in runs:
        rows += _rows(d)
    return "\n".join(rows) + source(list(HANDOVER_FILES), [run_info(d) for d in runs])


# ----------------------------------------------------------------------------- decode and ring write
PATH_FILE = "packet_path_cpu.json"  # benchmarks/packet_path_bench.py: in one process, no sockets
DECODE_RING_FILE = "packet_cost_decode_ring_cpu.json"  # packet_cost.py --tree before=... --tree after=.
PATH_CASES = {  # packet_path_bench.py case -> what it times
    "decode_ws_s16": "decode: /ws PCM16, 640 bytes",
    "decode_ws_f32": "decode: /ws float32, 1,280 bytes (NaN/Inf check)",
    "decode_realtime_24k": "decode: PCM16 at 24 kHz, resampled (soxr HQ)",
    "ring_write": "ring write: 320 float32 samples, position stored",
    "take_frame_ws_s16": "whole hand-over: /ws PCM16 (take_frame)",
    "take_frame_ws_f32": "whole hand-over: /ws float32 (take_frame)",
    "take_frame_realtime_24k": "whole hand-over: /v1/realtime append, base64 JSON, 24 kHz (take_frame)",
    "push_riva_16k": "whole hand-over: Riva 16 kHz bytes (RivaCall.push)",
    "floor_s16_into_ring": "sketch, not served: PCM16 scaled straight into the ring slice",
}


def table_packet_cost_decode() -> str:
    """In-process parts (branch point and this tree) over the socket figures of the same change."""
    d = read(PATH_FILE)
    base, tree = list(d["us_per_packet"])
    rows = ["| part (one 20 ms packet) | branch point: µs of CPU | this tree: µs of CPU | this tree / branch point |",
            "|---|---|---|---|"]  # fmt: skip
    for case, what in PATH_CASES.items():
        b, t = d["us_per_packet"][base][case], d["us_per_packet"][tree][case]
        rows.append(f"| {what} | {b:.2f} | {t:.2f} | {d['ratio'][case]:.2f} |")
    sockets = read(DECODE_RING_FILE)
    rows += ["", f"| path ({sockets['streams_per_frontend']} paced streams, 1 front end) | listener | run (window x repeats) "
             "| before: µs per packet (repeats) | after: µs per packet (repeats) | before / after "
             "| largest parts, after (µs per packet, py-spy) | target |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rows += _rows(sockets, ("before", "after"))
    return "\n".join(rows) + source([PATH_FILE, DECODE_RING_FILE], [run_info(d), run_info(sockets)])


# ----------------------------------------------------------------------------- cost against streams
# benchmarks/packet_cost_streams.py (a sweep of levels, the middle ones run twice)
STREAMS_FILES = ("packet_cost_streams_cpu.json",)
STREAM_PATHS = {  # packet_cost_streams.py path -> the row's name
    "ws_uvicorn": "/ws, 20 ms float32 frames, uvicorn (--port)",
    "ws_picows": "/ws, 20 ms float32 frames, picows (--fast-ws-port)",
    "realtime_picows": "/v1/realtime append, 20 ms base64 PCM16 at 16 kHz, picows (--fast-ws-port)",
}
VERDICT_WORDS = {"keeps_up": "", "generator_late": " (invalid: generator late)", "server_behind": " (invalid: server behind)",
                 "frontend_behind": " (invalid: front end behind)",
                 "core_behind": " (invalid: engine core behind, the front end on time)"}  # fmt: skip


def _streams_cell(row: dict) -> str:
    if row["verdict"] == "error":
        return "the load generator failed (invalid)"
    return f"{row['us_per_packet_all_in']:.1f} µs, p99 {row['send_lateness_ms']['p99']:.1f} ms{VERDICT_WORDS[row['verdict']]}"


def _first_met(rows: list[dict], target: float) -> str:
    """The target's verdict from valid levels only; what invalid runs showed is said apart."""
    valid = [r for r in rows if r["valid"]]
    met = [r for r in valid if r["us_per_packet_all_in"] <= target]
    if met:
        return f"met at {met[0]['streams']} streams"
    largest = max((r["streams"] for r in valid), default=None)
    words = f"**missed** at every valid level (the largest: {largest} streams)" if largest else "no valid level"
    seen = [r for r in rows if r.get("us_per_packet_all_in", target + 1) <= target]
    if seen:
        words += f"; under it from {seen[0]['streams']} streams in invalid runs (not shown)"
    return words


def table_packet_cost_streams() -> str:
    """Front-end µs per paced 20 ms packet at each streams-per-front-end level (every run of it,
    `;` apart), with the load generator's p99 lateness and each run's verdict."""
    runs = [read(name) for name in STREAMS_FILES if (page_results.RESULTS / name).exists()]
    all_rows = sorted((r for d in runs for r in d["rows"]), key=lambda r: r["streams"])
    levels = sorted({r["streams"] for r in all_rows})
    target = runs[0]["target_us_per_packet"]
    rows = ["| path (1 front end, paced 20 ms packets) | " + " | ".join(f"{n} streams" for n in levels)
            + " | target |", "|---|" + "---|" * len(levels) + "---|"]  # fmt: skip
    for path, name in STREAM_PATHS.items():
        mine = [r for r in all_rows if r["path"] == path]
        cells = ["; ".join(_streams_cell(r) for r in mine if r["streams"] == n) or "-" for n in levels]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {target} µs: {_first_met(mine, target)} |")
    names = [n for n in STREAMS_FILES if (page_results.RESULTS / n).exists()]
    return "\n".join(rows) + source(names, [run_info(d) for d in runs])


# ----------------------------------------------------------------------------- the blast sender's levels
# benchmarks/packet_cost_streams.py --client blast (benchmarks/blast.py), 256 to 1,000 streams:
# file -> how its processes were placed
BLAST_FILES = {"packet_cost_streams_blast_cpu.json": "cores shared",
               "packet_cost_streams_blast_pin_cpu.json": "pinned (--pin)"}  # fmt: skip


# packet_cost_streams.py names a level whose front end read on time but whose results came late
# core_behind, so with this client server_behind means the front end left packets unread as well
BLAST_VERDICT_WORDS = VERDICT_WORDS | {"server_behind": " (invalid: front end behind, results late)"}


def _blast_cell(row: dict) -> str:
    if row["verdict"] == "error":
        return "the sender failed (invalid)"
    return (f"{row['us_per_packet_all_in']:.1f} µs (p99 {row['send_lateness_ms']['p99']:.1f} ms; "
            f"{row['unread_packets_per_stream_end']:.1f} unread; core {row['core_cores_in_window']:.2f}{_waited(row)})"
            f"{BLAST_VERDICT_WORDS[row['verdict']]}")  # fmt: skip


def _waited(row: dict) -> str:
    wait = row.get("frontend_waiting_for_cpu_in_window")  # recorded from f2f987d on
    return "" if wait is None else f"; front end waited {wait:.2f} for a CPU"


def _at_top(rows: list[dict], target: float) -> str:
    """The target's word at the largest level run (issue 48 names 1,000 streams): met only if
    every run of that level was valid and within it."""
    top = max(r["streams"] for r in rows)
    mine = [r for r in rows if r["streams"] == top]
    if all(r["valid"] and r["us_per_packet_all_in"] <= target for r in mine):
        return f"met at {top:,} streams"
    if all(r["valid"] for r in mine):
        return f"**missed** at {top:,} streams"
    return f"**not shown** at {top:,} streams (invalid)"


def table_packet_cost_streams_blast() -> str:
    """Per placement, path and level: front-end µs per paced 20 ms packet, the sender's p99
    lateness, packets a stream left unread at the window's end, the engine core's cores, and each
    run's verdict; the sender's own CPU under it."""
    runs = {name: read(name) for name in BLAST_FILES if (page_results.RESULTS / name).exists()}
    rows = [r | {"placed": BLAST_FILES[name]} for name, d in runs.items() for r in d["rows"]]
    target = next(iter(runs.values()))["target_us_per_packet"]
    levels = sorted({r["streams"] for r in rows})
    out = ["| path (1 front end, paced 20 ms packets, blast sender) | processes | " + " | ".join(f"{n:,} streams" for n in levels)
           + " | target |", "|---|---|" + "---|" * len(levels) + "---|"]  # fmt: skip
    for path, name in STREAM_PATHS.items():
        for placed in BLAST_FILES.values():
            mine = [r for r in rows if r["path"] == path and r["placed"] == placed]
            if mine:
                cells = ["; ".join(_blast_cell(r) for r in mine if r["streams"] == n) or "-" for n in levels]
                out.append(f"| {name} | {placed} | " + " | ".join(cells)
                           + f" | {target} µs: {_first_met(mine, target)}; {_at_top(mine, target)} |")  # fmt: skip
    sender = [x["pacing_us_per_packet"] for r in rows if r.get("sender") for x in r["sender"]]
    out.append(f"\nThe sender's own CPU: {min(sender):.1f} to {max(sender):.1f} µs per packet (its kernel time included) over these runs.")
    return "\n".join(out) + source(list(runs), [run_info(d) for d in runs.values()])


# ----------------------------------------------------------------------------- uvicorn's frame parsing
UVICORN_FRAMES_FILES = {  # packet_cost.py --tree before=... --tree after=. -> the paths shown from it
    "packet_cost_uvicorn_frames_cpu.json": ("ws_f32_20ms", "ws_s16_20ms"),
    "packet_cost_uvicorn_frames_realtime_cpu.json": ("realtime_24k_20ms_novad",),
}


def table_packet_cost_uvicorn_frames() -> str:
    """/ws and /v1/realtime through uvicorn with whole data frames parsed in uvicorn_protocols.py (not
    websockets' generators), side by side with the branch point; picows's, unchanged, the noise control."""
    runs = {name: read(name) for name in UVICORN_FRAMES_FILES}
    first = next(iter(runs.values()))
    rows = [f"| path ({first['streams_per_frontend']} paced streams, 1 front end) | listener | run (window x repeats) "
            "| before: µs per packet (repeats) | after: µs per packet (repeats) | before / after "
            "| largest parts, after (µs per packet, py-spy) | target |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, d in runs.items():
        rows += _rows(d, ("before", "after"), UVICORN_FRAMES_FILES[name])
    return "\n".join(rows) + source(list(runs), [run_info(d) for d in runs.values()])


UVICORN_BLAST_RUNS = ("after1", "before1", "before2", "after2", "before3", "after3", "after4", "before4")  # run order


def table_packet_cost_uvicorn_frames_blast() -> str:
    """The same change at 256 paced streams, pinned, blast sender: one run a row, in the order they
    ran (before: packet_cost_streams.py --tree <branch point>), and each tree's median of its valid runs."""
    names = [f"packet_cost_streams_blast_uvicorn_{run}_cpu.json" for run in UVICORN_BLAST_RUNS]
    runs = {name: read(name) for name in names if (page_results.RESULTS / name).exists()}
    rows = ["| run (in order) | server code | /ws through uvicorn, 256 streams, pinned |", "|---|---|---|"]
    by_tree: dict[str, list[float]] = {}
    for name, d in runs.items():
        run = name.removeprefix("packet_cost_streams_blast_uvicorn_").removesuffix("_cpu.json")
        commit = d["run"].get("server_tree_commit") or d["run"]["git_commit"]
        row = d["rows"][0]
        tree = run.rstrip("0123456789")
        if row["valid"]:
            by_tree.setdefault(tree, []).append(row["us_per_packet_all_in"])
        rows.append(f"| {run} | {tree} ({commit}) | {_blast_cell(row)} |")
    medians = "; ".join(f"{tree} {statistics.median(v):.1f} µs ({len(v)} valid run{'s' * (len(v) > 1)})"
                        for tree, v in sorted(by_tree.items()))  # fmt: skip
    rows.append(f"\nMedians of the valid runs: {medians}.")
    return "\n".join(rows) + source(list(runs), [run_info(d) for d in runs.values()])


# ----------------------------------------------------------------------------- /v1/realtime at the SDK's shape
# packet_cost_streams.py --client blast --pin, 256 streams, run after run: /v1/realtime appends of
# 20 ms base64 PCM16 at 24 kHz through both listeners, /ws beside them in the same server; then the
# same appends at 24 and at 16 kHz (no resampling) through picows, /ws beside them
REALTIME24K_FILE = "packet_cost_streams_blast_realtime24k_cpu.json"
REALTIME24K_VS16K_FILE = "packet_cost_streams_blast_realtime24k_vs16k_cpu.json"
REALTIME24K_PATHS = {
    "realtime24k_uvicorn": "/v1/realtime append, 20 ms base64 PCM16 at 24 kHz (the SDK's), uvicorn (--port)",
    "realtime24k_picows": "/v1/realtime append, 20 ms base64 PCM16 at 24 kHz (the SDK's), picows (--fast-ws-port)",
    "ws_uvicorn": "/ws, 20 ms float32 frames, uvicorn (--port), for comparison",
    "ws_picows": "/ws, 20 ms float32 frames, picows (--fast-ws-port), for comparison",
    "realtime_picows": "/v1/realtime append, 20 ms base64 PCM16 at 16 kHz (no resampling), picows (--fast-ws-port), for comparison",
}


def _by_median(valid: list[float], target: float) -> str:
    """The target's word from the median of the valid runs (one run within it among several over
    it is this machine's spread, not the target met), with how many runs were within it."""
    if not valid:
        return "no valid run"
    word = "met" if statistics.median(valid) <= target else "**missed**"
    return f"{word} by the median; {sum(v <= target for v in valid)} of {len(valid)} valid runs within it"


def table_packet_cost_streams_blast_realtime24k() -> str:
    return _realtime24k_table(REALTIME24K_FILE)


def table_packet_cost_streams_blast_realtime24k_vs16k() -> str:
    return _realtime24k_table(REALTIME24K_VS16K_FILE)


def _realtime24k_table(name: str) -> str:
    """Per path: every run's cell (in the order they ran, `;` apart), the streams whose final tokens
    equal their item's reference (/v1/realtime at 24 kHz: its own at one stream per item; the
    others: /ws's), the median of the valid runs and the target's word by that median."""
    runs = {name: read(name)}
    rows = [r for d in runs.values() for r in d["rows"]]
    target, levels = next(iter(runs.values()))["target_us_per_packet"], sorted({r["streams"] for r in rows})
    out = ["| path (1 front end, pinned, paced 20 ms packets, blast sender) | " + " | ".join(f"{n:,} streams, each run" for n in levels)
           + " | median of the valid runs | streams whose finals equal the reference | target |",
           "|---|" + "---|" * len(levels) + "---|---|---|"]  # fmt: skip
    for path, name in REALTIME24K_PATHS.items():
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        cells = ["; ".join(_blast_cell(r) for r in mine if r["streams"] == n) or "-" for n in levels]
        valid = [r["us_per_packet_all_in"] for r in mine if r["valid"]]
        median = f"{statistics.median(valid):.1f} µs ({len(valid)} of {len(mine)} runs)" if valid else f"none valid (0 of {len(mine)})"
        same = ", ".join(f"{r['quality'].get('token_identical_streams', '-')}/{r['quality'].get('streams_compared', '-')}"
                         for r in mine if r.get("quality"))  # fmt: skip
        out.append(f"| {name} | " + " | ".join(cells) + f" | {median} | {same or '-'} | {target} µs: {_by_median(valid, target)} |")
    refs = [d["reference"]["realtime24k"] for d in runs.values() if (d.get("reference") or {}).get("realtime24k")]
    out += [f"\nThe 24 kHz reference (one stream per item, before the levels): {r['items_equal_to_ws']} of "
            f"{len(r['tokens_per_item'])} items' tokens equal to /ws's at 16 kHz." for r in refs]
    return "\n".join(out) + source(list(runs), [run_info(d) for d in runs.values()])
