"""The tables of docs/performance.md, README.md's headline table and docs/demo_model.md's WER table,
regenerated from the result files in benchmarks/results/.

    python benchmarks/performance_page.py           # rewrite the tables in place
    python benchmarks/performance_page.py --check   # exit 1 when a page differs from its results,
                                                    # or a figure in README.md or docs/ is unbacked

A table sits between `<!-- table: NAME -->` and `<!-- /table -->`; everything outside those
markers is written by hand. Under each table a line names the files it came from and the
command, commit and date that made each one. A figure written by hand elsewhere in README.md or
docs/*.md must sit under `<!-- figures: FILE -->` and equal a number of that result file
(benchmarks/page_figures.py says what counts as a figure). A result file whose recorded command
wrote elsewhere (`--out /tmp/...`) must be said to be copied (benchmarks/performance_page_outs.py).
Nothing here measures: the commands that do are in
benchmarks/README.md.

This module is the command line and the marker rewriting; the tables are rendered by
page_gpu.py (the GPU rows and README's headline), page_cpu.py (CPU step, host, front end, sweeps)
and page_quality.py (overload, fuzz, WER, phrase boosting), all reading through page_results.py.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the pages' root (tests point it at a copy)
sys.path.insert(0, str(ROOT))
from benchmarks import page_cpu, page_gpu, page_quality, page_results  # noqa: E402
from benchmarks.grpc_cost_table import (  # noqa: E402
    table_grpc_layer,
    table_packet_cost_fastgrpc,
    table_packet_cost_streams_blast_grpc,
)
from benchmarks.packet_cost_table import (  # noqa: E402
    table_packet_cost_decode,
    table_packet_cost_handover,
    table_packet_cost_streams,
    table_packet_cost_streams_blast,
    table_packet_cost_streams_blast_realtime24k,
    table_packet_cost_streams_blast_realtime24k_vs16k,
    table_packet_cost_uvicorn_frames,
    table_packet_cost_uvicorn_frames_blast,
)
from benchmarks.page_figures import PENDING, unbacked  # noqa: E402
from benchmarks.performance_page_outs import unsaid_copies  # noqa: E402

PAGES = ("README.md", "docs/performance.md", "docs/demo_model.md")  # the pages with generated tables


def checked_pages() -> list[str]:
    """Every page whose figures must be backed: README.md and docs/*.md."""
    return ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


TABLES = {  # marker name -> the function that renders it
    "headline": page_gpu.table_headline, "gpu": page_gpu.table_gpu, "gpu-load": page_gpu.table_gpu_load,
    "gpu-memory": page_gpu.table_gpu_memory,
    "step": page_cpu.table_step, "host": page_cpu.table_host, "frontend": page_cpu.table_frontend,
    "sweeps": page_cpu.table_sweeps, "mode-mix": page_cpu.table_mode_mix, "ring": page_cpu.table_ring,
    "packet-cost": page_cpu.table_packet_cost, "ws-layer": page_cpu.table_ws_layer,
    "packet-cost-ring": page_cpu.table_packet_cost_ring, "packet-cost-handover": table_packet_cost_handover,
    "packet-cost-decode": table_packet_cost_decode, "packet-cost-streams": table_packet_cost_streams,
    "packet-cost-streams-blast": table_packet_cost_streams_blast,
    "grpc-layer": table_grpc_layer, "packet-cost-fastgrpc": table_packet_cost_fastgrpc,
    "packet-cost-uvicorn-frames": table_packet_cost_uvicorn_frames,
    "packet-cost-uvicorn-frames-blast": table_packet_cost_uvicorn_frames_blast,
    "packet-cost-streams-blast-grpc": table_packet_cost_streams_blast_grpc,
    "packet-cost-streams-blast-realtime24k": table_packet_cost_streams_blast_realtime24k,
    "packet-cost-streams-blast-realtime24k-vs16k": table_packet_cost_streams_blast_realtime24k_vs16k,
    "demo-wer": page_quality.table_demo_wer, "boost-benefit": page_quality.table_boost_benefit,
    "boost-cost": page_quality.table_boost_cost, "overload": page_quality.table_overload, "fuzz": page_quality.table_fuzz,
}
MARKED = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def render(text: str, cache: dict[str, str]) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        if name not in cache:
            cache[name] = TABLES[name]()
        return f"{m.group(1)}{cache[name]}\n{m.group(4)}"

    return MARKED.sub(fill, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is out of date")
    args = ap.parse_args(argv)
    cache: dict[str, str] = {}
    stale = []
    for rel in PAGES:
        path = ROOT / rel
        old = path.read_text()
        new = render(old, cache)
        if new != old:
            stale.append(rel)
            if not args.check:
                path.write_text(new)
    verb = "out of date" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "every page matches its results")
    loose = unbacked(ROOT, page_results.RESULTS, checked_pages())
    for problem in loose:
        print(f"unbacked figure: {problem}")
    for (page, figure), why in PENDING.items():
        print(f"pending, not failing: {page}: {figure} ({why})")
    moved = unsaid_copies(ROOT, page_results.RESULTS, [*checked_pages(), "benchmarks/README.md"])
    for problem in moved:
        print(f"result file written elsewhere: {problem}")
    return 1 if args.check and (stale or loose or moved) else 0


if __name__ == "__main__":
    sys.exit(main())
