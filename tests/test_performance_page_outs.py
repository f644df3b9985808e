"""A result file whose recorded command wrote elsewhere must be said to be copied (issue 51, item 3)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import page_results, performance_page
from benchmarks.performance_page_outs import unsaid_copies, written_elsewhere

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*performance_page.checked_pages(), "benchmarks/README.md"]


def test_every_result_written_elsewhere_is_said_to_be_copied():
    assert unsaid_copies(ROOT, page_results.RESULTS, PAGES) == []


def test_where_a_command_wrote():
    name = "x_cpu.json"
    assert written_elsewhere(name, "python b.py --out benchmarks/results/x_cpu.json") is None
    assert written_elsewhere(name, "python b.py --out /work/wt-a/benchmarks/results/x_cpu.json") is None
    assert written_elsewhere(name, "python b.py --out=x_cpu.json") is None
    assert written_elsewhere(name, "bash run.sh OUT") is None  # a placeholder names no place
    assert written_elsewhere(name, "python b.py --notes 'load > 5' --out benchmarks/results/x_cpu.json") is None
    assert written_elsewhere(name, "python b.py --out /tmp/a/x_cpu.json") == "/tmp/a/x_cpu.json"
    assert written_elsewhere(name, "python b.py > /tmp/x_cpu.json") == "/tmp/x_cpu.json"
    assert written_elsewhere(name, "python b.py --out benchmarks/results/y_cpu.json") == "benchmarks/results/y_cpu.json"
    # a model's --out beside the result file's own flag: the file is the command's own
    assert written_elsewhere(name, "python c.py --out work_data/m.nemo --report benchmarks/results/x_cpu.json") is None
    assert written_elsewhere(name, "python c.py --out work_data/m.nemo --report benchmarks/results/xx_cpu.json") == "work_data/m.nemo"


def test_a_planted_copy_is_named_until_a_line_says_so(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    run = {"run": {"command": "python benchmarks/packet_cost.py --out /tmp/f/pc_cpu.json", "git_commit": "abc1234"}}
    (results / "pc_cpu.json").write_text(json.dumps(run))
    (results / "own_cpu.json").write_text(json.dumps({"command": "python b.py --out benchmarks/results/own_cpu.json"}))
    (results / "gpu.jsonl").write_text(json.dumps({"kind": "run", "command": "python g.py > /tmp/g.jsonl"}) + "\n")
    page = tmp_path / "x.md"
    page.write_text("From `pc_cpu.json` and `gpu.jsonl`.\n")
    assert unsaid_copies(tmp_path, results, ["x.md"]) == [
        "gpu.jsonl: its command wrote /tmp/g.jsonl; no line naming it says it was copied",
        "pc_cpu.json: its command wrote /tmp/f/pc_cpu.json; no line naming it says it was copied"]
    page.write_text("From `pc_cpu.json` (written to /tmp, copied here).\nThe copied one is elsewhere: `gpu.jsonl`.\n")
    assert unsaid_copies(tmp_path, results, ["x.md"]) == []


def test_a_generated_source_line_says_where_its_file_was_written():
    info = {"command": "python benchmarks/packet_cost.py --notes 'a > b' --out /tmp/f/pc_cpu.json", "commit": "abc1234",
            "date": "2026-12-06"}
    assert "`python benchmarks/packet_cost.py --notes ... --out /tmp/f/pc_cpu.json` (written to `/tmp/f/pc_cpu.json`, " \
           "copied here) at abc1234" in page_results.source(["pc_cpu.json"], [info])
    info["command"] = "python benchmarks/packet_cost.py --out benchmarks/results/pc_cpu.json"
    assert "copied" not in page_results.source(["pc_cpu.json"], [info])
