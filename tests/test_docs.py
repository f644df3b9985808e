"""The documentation: README.md stays a short front door whose links resolve, and every table
of docs/performance.md, README.md's headline and docs/demo_model.md's WER table equals what
benchmarks/performance_page.py renders from benchmarks/results/ (no hand-edited numbers)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import page_figures, page_gpu, page_quality, page_results, performance_page

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 12 * 1024
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.encode()) <= README_MAX_BYTES, len(text.encode())
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("bash env/setup.sh && .venv/bin/nemo-serve --selftest 20")
    assert first_block[1].startswith(".venv/bin/python -m pytest")
    assert ".venv/bin/python -m pytest" in (ROOT / ".ci" / "run").read_text()  # the second is what CI runs


def test_server_guide_is_short_and_names_no_removed_mode():
    """docs/server.md is what a user runs from (issue 47): under 25 KB, measurements in performance.md."""
    text = (ROOT / "docs" / "server.md").read_text()
    assert len(text.encode()) < 25 * 1024, len(text.encode())
    for page in ["README.md", "benchmarks/README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]:
        assert "--frontends 0" not in (ROOT / page).read_text(), page


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.M)}


@pytest.mark.parametrize("page", ["README.md", "docs/server.md", "docs/performance.md", "docs/demo_model.md",
                                  "docs/how_it_works.md", "docs/protocol.md", "docs/ray_serve.md", "docs/deepgram_prerecorded.md",
                                  "benchmarks/README.md", "CHANGELOG.md"])
def test_relative_links_resolve(page):
    path = ROOT / page
    text = path.read_text()
    broken = []
    for target, anchor in LINK.findall(text) + [(page, a) for a in re.findall(r"\]\((#[^)]+)\)", text)]:
        if "://" in target or target.startswith("mailto:"):
            continue
        file = path if target == page else path.parent / target
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor[1:] not in _anchors(file.read_text()):
            broken.append(target + anchor)
    assert not broken, f"{page} has links that lead nowhere: {broken}"


def test_pages_match_their_result_files():
    assert performance_page.main(["--check"]) == 0, "run: python benchmarks/performance_page.py"
    for page in performance_page.PAGES:
        assert "<!-- table: " in (ROOT / page).read_text(), page


def test_a_changed_result_changes_the_page(tmp_path, monkeypatch):
    """The tables are read from the files: a level that fell behind must show as fewer streams kept up."""
    results = tmp_path / "results"
    shutil.copytree(page_results.RESULTS, results)
    gpu = results / page_gpu.GPU_RUN["file"]
    recs = [json.loads(line) for line in gpu.read_text().splitlines() if line.strip()]
    for r in recs:
        if r["kind"] == "capacity" and r["chunk_ms"] == 80:
            r["keeps_up"] = False
    gpu.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    monkeypatch.setattr(page_results, "RESULTS", results)

    row = next(line for line in page_gpu.table_gpu().splitlines() if line.startswith("| 80 ms"))
    assert "| **0** " in row and "missed" in row, row
    page = (ROOT / "docs" / "performance.md").read_text()
    assert performance_page.render(page, {}) != page


def test_the_overload_table_is_read_from_its_files(tmp_path, monkeypatch):
    """The overload figures come from the overload results: a changed file changes the page."""
    results = tmp_path / "results"
    shutil.copytree(page_results.RESULTS, results)
    path = results / "overload_demo_r13_cpu.json"
    d = json.loads(path.read_text())
    d["runs"][1]["level"]["quality"]["token_identical_streams"] -= 1
    path.write_text(json.dumps(d))
    monkeypatch.setattr(page_results, "RESULTS", results)
    row = next(line for line in page_quality.table_overload().splitlines() if "token-identical" in line)
    assert "| 293/294 |" in row, row
    page = (ROOT / "docs" / "performance.md").read_text()
    assert performance_page.render(page, {}) != page


# ----------------------------------------------------------------------------- hand-written figures


def _pages_copy(tmp_path: Path) -> Path:
    """README.md and docs/ copied, so a test can plant a figure; the result files stay the real ones."""
    (tmp_path / "docs").mkdir()
    shutil.copy(README, tmp_path / "README.md")
    for page in (ROOT / "docs").glob("*.md"):
        shutil.copy(page, tmp_path / "docs" / page.name)
    return tmp_path


def test_every_hand_written_figure_is_backed():
    assert page_figures.unbacked(ROOT, page_results.RESULTS, performance_page.checked_pages()) == []


def test_a_planted_unbacked_figure_fails_the_check_naming_its_line(tmp_path, monkeypatch, capsys):
    root = _pages_copy(tmp_path)
    server = root / "docs" / "server.md"
    text = server.read_text().rstrip("\n") + "\n\nA stream's first partial arrives 12.3 ms after its audio.\n"
    server.write_text(text)
    line = text.count("\n")
    monkeypatch.setattr(performance_page, "ROOT", root)
    assert performance_page.main(["--check"]) == 1
    assert f"unbacked figure: docs/server.md:{line}: 12.3 ms (no result file backs it)" in capsys.readouterr().out


def test_a_figure_under_a_marker_must_equal_a_number_of_its_file(tmp_path):
    """riva_vs_ws_demo_r13.json's gRPC median tail is 24.9 ms: 25 ms is backed, 31 ms and 41.7 ms are not."""
    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    marked = "<!-- figures: riva_vs_ws_demo_r13.json -->\nThe last final came {} after the last audio.\n"
    results = page_results.RESULTS
    page.write_text(marked.format("25 ms"))
    assert page_figures.unbacked(tmp_path, results, ["docs/x.md"]) == []
    for wrong in ("31 ms", "41.7 ms", "300 times"):
        page.write_text(marked.format(wrong))
        assert page_figures.unbacked(tmp_path, results, ["docs/x.md"]) == [
            f"docs/x.md:2: {wrong} (not in riva_vs_ws_demo_r13.json)"]
    page.write_text("<!-- figures: no_such_run.json -->\nIt took 25 ms.\n")
    assert "no such result file" in page_figures.unbacked(tmp_path, results, ["docs/x.md"])[0]


def test_a_table_row_takes_its_figures_from_one_record(tmp_path):
    """loadgen_capacity_clients_w1_cpu.json: websockets at 100 streams, 124.4 µs per packet and p99
    lateness 4.05 ms; at 200 streams 8.82 ms; picows at 100 streams 95.6 µs, at 200 74.4 µs. A row
    whose cells come from two levels fails, though each cell is in the file; so does one that mixes
    across a spanned field (`span:client`: one record per client, of one level)."""
    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    table = "<!-- figures: loadgen_capacity_clients_w1_cpu.json{} -->\n| streams | CPU | p99 |\n|---|---|---|\n| 100 | {} | {} |\n"

    def check(span: str, cpu: str, p99: str) -> list[str]:
        page.write_text(table.format(span, cpu, p99))
        return page_figures.unbacked(tmp_path, page_results.RESULTS, ["docs/x.md"])

    assert check("", "124.4 µs", "4.05 ms") == []
    mixed = check("", "124.4 µs", "8.82 ms")
    assert len(mixed) == 1 and mixed[0].startswith("docs/x.md:4: a table row ("), mixed  # names 124.4 or 8.82
    assert check("", "124.4 µs", "95.6 µs") != []  # two clients: two records, unless the table says it spans them
    assert check(" span:client", "124.4 µs", "95.6 µs") == []
    mixed = check(" span:client", "124.4 µs", "74.4 µs")  # picows at 200 streams beside websockets at 100
    assert len(mixed) == 1 and "a table row" in mixed[0], mixed


def test_a_row_spanning_a_field_takes_one_setting_of_the_rest(tmp_path):
    """confidence_engine_demo_cpu.json, a row per chunk mode and a column per batch (`span:batch`):
    batch 16 at 80 ms fits beside batch 1 at 80 ms; batch 16 at 1120 ms does not (another `chunk_ms`)."""
    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    table = ("<!-- figures: confidence_engine_demo_cpu.json span:batch -->\n| | batch 1 | batch 16 |\n|---|---|---|\n"
             "| demo, 80 ms | +0.10 ms (+1.7%) of 5.8 ms | {} |\n")

    def check(cell: str) -> list[str]:
        page.write_text(table.format(cell))
        return page_figures.unbacked(tmp_path, page_results.RESULTS, ["docs/x.md"])

    assert check("+0.20 ms (+1.0%) of 20.1 ms") == []
    assert [p.split(" (")[0] for p in check("within noise (-0.1%) of 76 ms")] == ["docs/x.md:4: a table row"]


def test_what_is_not_a_measurement(tmp_path):
    """Code, chunk modes, limit lines and settings paragraphs are not figures; the same number in prose is."""
    page = tmp_path / "x.md"
    page.write_text("```\nstep 5 ms\n```\n\nRun `sleep 5 s` at 80 / 1120 ms chunks.\n\n"
                    "`--idle-timeout-s` closes a stream after 30 s.\n\n<!-- figures: settings -->\n"
                    "Each item is 20 s of audio.\n\nA step took 5 ms.\n")
    assert page_figures.unbacked(tmp_path, page_results.RESULTS, ["x.md"]) == ["x.md:12: 5 ms (no result file backs it)"]


def test_the_gpu_rows_name_the_commit_and_command_their_file_records(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(page_results.RESULTS, results)
    gpu = results / page_gpu.GPU_RUN["file"]
    recs = [json.loads(line) for line in gpu.read_text().splitlines() if line.strip()]
    run = next(r for r in recs if r["kind"] == "run")
    run["git_commit"], run["command"] = "abc1234", "bash benchmarks/gpu/run_gpu.sh ELSEWHERE"
    gpu.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    monkeypatch.setattr(page_results, "RESULTS", results)
    assert all("abc1234 |" in row for row in page_gpu.table_headline().splitlines() if "H200" in row)
    assert "`bash benchmarks/gpu/run_gpu.sh ELSEWHERE` at abc1234" in page_gpu.table_gpu()


# ----------------------------------------------------------------------------- docs/server.md's Limits table


def _setting_default(name: str) -> float:
    from nemo_serve.config import Settings

    return Settings.model_fields[name].default


def _constants():
    """Each Limits row's numbers besides `--flag N` pairs, in the order the row writes them, with the
    value in the code each must equal (as written: its unit and decimals). A number the table gains
    without an entry here fails the check, so a value is never written by hand alone."""
    from nemo_serve.server import auth, connections, file_audio, nim_body, outbox, realtime, stream_session

    mib, max_stream_s = 2**20, _setting_default("max_stream_s")
    return {
        "connections in all": [("64", connections.FILE_RESERVE)],  # `ulimit -n` minus this
        "probes beyond those caps": [("8 connections", connections.MAX_PROBE_CONNECTIONS)],
        "an upload to": [("25 MiB", _setting_default("max_file_bytes") / mib)],
        "an uploaded file's header": [("1 to", file_audio.MIN_RATE / 1e3), ("192 kHz", file_audio.MAX_RATE / 1e3),
                                      ("1 to", 1), ("8 channels", file_audio.MAX_CHANNELS)],  # 1 channel: mono
        "an uploaded file's length": [("96,000 samples", file_audio.MAX_INPUT_SAMPLES_PER_LIMIT_S),
                                      ("48 kHz", file_audio.MAX_INPUT_SAMPLES_PER_LIMIT_S / 2 / 1e3)],  # stereo
        "memory to decode an upload": [("4 bytes", 4), ("230 MB", 4 * 16000 * max_stream_s / 1e6),  # float32
                                       ("16 kHz", 16), ("16 MiB", 4 * file_audio.BLOCK_BYTES / mib)],
        "slots one `/v1/realtime` session holds": [("2", realtime.MAX_SLOTS_PER_SESSION)],
        "a forged, malformed or expired client secret": [("60 s", auth.CLIENT_SECRET_TTL_S)],
        "a frame larger than": [("1 MiB", _setting_default("max_message_bytes") / mib)],
        "NIM's session POST body": [("64 kB", nim_body.MAX_BODY_BYTES / 1024), ("32 levels", nim_body.MAX_NESTING),
                                    ("100 digits", nim_body.MAX_INT_DIGITS)],
        "audio read ahead of the model": [("20 s", stream_session.MAX_AHEAD_S)],
        "results not read for": [("64 messages", outbox.MAX_QUEUED)],
        "tokens a partial carries whole": [("256", outbox.WHOLE_PARTIAL_MAX_TOKENS)],
    }


FLAG_VALUE = re.compile(r"`--([a-z-]+)`(?: (\d+(?:,\d{3})*(?:\.\d+)?))?")


def _as_written(text: str, value: float) -> bool:
    n = re.match(r"\d+(?:,\d{3})*(?:\.\d+)?", text).group(0).replace(",", "")
    decimals = len(n.split(".")[1]) if "." in n else 0
    return round(value, decimals) == float(n)


def limit_problems(server_md: str) -> list[str]:
    """What in server.md's Limits table disagrees with the code: a flag that does not exist, a flag's
    default written wrong, or another number not equal to its constant (or tied to none)."""
    from nemo_serve.config import Settings

    table = server_md.split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| limit |")]
    constants, problems = _constants(), []
    for row in rows:
        label, defaults = (c.strip() for c in row.strip("|").split("|")[:2])
        for flag, written in FLAG_VALUE.findall(defaults):
            name = flag.replace("-", "_")
            if name not in Settings.model_fields:
                problems.append(f"{label}: --{flag} is no flag")
            elif written and not _as_written(written, _setting_default(name)):
                problems.append(f"{label}: --{flag} {written}, the code's default is {_setting_default(name)}")
        rest = re.sub(r"\[[^\]]*\]\([^)]*\)|`[^`]*`|\b0:", "", FLAG_VALUE.sub("", defaults))  # links, code, "0: off"
        found = re.findall(r"\d+(?:,\d{3})*(?:\.\d+)?(?: ?[A-Za-z]+)?", rest)
        expected = next((v for k, v in constants.items() if label.startswith(k)), [])
        if [_shape(text) for text in found] != [_shape(text) for text, _ in expected]:
            problems.append(f"{label}: numbers {found}, tied to the code: {[text for text, _ in expected]}")
            continue
        problems += [f"{label}: {text}, the code says {value}"
                     for text, (_, value) in zip(found, expected) if not _as_written(text, value)]
    return problems


def _shape(figure: str) -> str:
    """'20 s' -> 'N s': a row's numbers are matched to their constants by place and unit, then compared."""
    return re.sub(r"\d+(?:,\d{3})*(?:\.\d+)?", "N", figure)


def test_every_limit_in_the_server_guide_is_the_codes():
    assert limit_problems((ROOT / "docs" / "server.md").read_text()) == []


@pytest.mark.parametrize("planted, problem", [
    ("`--send-timeout-s` 10", "results not read for: --send-timeout-s 15, the code's default is 10.0"),
    ("`--max-file-bytes` 26214400", "--max-file-bytes 26214401, the code's default is 26214400"),
    ("| audio read ahead of the model | 20 s |", "audio read ahead of the model: 25 s, the code says 20.0"),
    ("| 60 s lifetime |", "a forged, malformed or expired client secret on `/v1/realtime`: 65 s, the code says 60"),
    ("`--idle-timeout-s` 30", "nothing sent for: --idle-timeouts-s is no flag"),
    ("`--max-phrases-total` 10000", "numbers ['3 retries'], tied to the code: []"),
])
def test_a_planted_wrong_limit_is_named(planted, problem):
    wrong = {"`--send-timeout-s` 10": "`--send-timeout-s` 15", "`--max-file-bytes` 26214400": "`--max-file-bytes` 26214401",
             "| audio read ahead of the model | 20 s |": "| audio read ahead of the model | 25 s |",
             "| 60 s lifetime |": "| 65 s lifetime |", "`--idle-timeout-s` 30": "`--idle-timeouts-s` 30",
             "`--max-phrases-total` 10000": "`--max-phrases-total` 10000, 3 retries"}[planted]
    text = (ROOT / "docs" / "server.md").read_text()
    assert text.count(planted) == 1, planted
    problems = limit_problems(text.replace(planted, wrong))
    assert len(problems) == 1 and problem in problems[0], problems


def test_a_count_of_cases_needs_a_result_file_or_the_test_that_asserts_it(tmp_path):
    """`k/n` and `k of n` are figures without a unit (issue 51 item 7): unbacked they fail, also on a
    line naming a flag; the test named in their sentence (a file that exists) backs them, a test
    named in an earlier sentence or a missing test file does not."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_real.py").write_text("")
    page = tmp_path / "x.md"
    results = page_results.RESULTS
    cases = {
        "The client printed 23/24 transcripts whole.": ["x.md:1: 23/24 (no result file backs it)"],
        "`--selftest 24` gave 5 of 24 right.": ["x.md:1: 5 of 24 (no result file backs it)"],
        "`tests/test_real.py` holds it: 24/24 equal.": [],
        "| client | `tests/test_real.py` | 24/24 |": [],
        "`tests/test_gone.py` holds it: 24/24 equal.": ["x.md:1: 24/24 (no result file backs it)"],
        "Tested by `tests/test_real.py`. Then by hand\n3/4 equal.": ["x.md:2: 3/4 (no result file backs it)"],
        "Tested by `tests/test_real.py` on\nall files, 24/24 equal.": [],
        "HTTP 431 / 414 closes it.": [],
    }
    for text, expected in cases.items():
        page.write_text(text + "\n")
        assert page_figures.unbacked(tmp_path, results, ["x.md"]) == expected, text


def test_inline_code_wrapped_over_a_line_hides_no_figure_and_keeps_the_mark(tmp_path):
    """A code span that wraps a line was paired with the next line's backtick, so the prose between
    (here `5 ms`) was read as code; and the blank prose lines a wrapped span leaves must not end the
    paragraph of its `figures` mark (the figure after it is checked against the mark's file)."""
    page = tmp_path / "x.md"
    results = page_results.RESULTS
    page.write_text("Ran `tool\n--y` and it took 5 ms with `z`.\n")
    assert page_figures.unbacked(tmp_path, results, ["x.md"]) == ["x.md:2: 5 ms (no result file backs it)"]
    page.write_text("<!-- figures: riva_vs_ws_demo_r13.json -->\nRun (`a\nb\nc`), then 31 ms.\n")
    assert page_figures.unbacked(tmp_path, results, ["x.md"]) == ["x.md:4: 31 ms (not in riva_vs_ws_demo_r13.json)"]


def test_device_waits_and_cores_are_units(tmp_path):
    """'2 waits per iteration' and '0.9 core' are measurements (how_it_works.md, performance.md)."""
    page = tmp_path / "x.md"
    page.write_text("The GPU saw 7 waits per iteration.\n\nThe front end used 0.7 core.\n")
    assert page_figures.unbacked(tmp_path, page_results.RESULTS, ["x.md"]) == [
        "x.md:1: 7 waits (no result file backs it)", "x.md:3: 0.7 core (no result file backs it)"]


def test_late_ticks_of_the_load_client_are_figures(tmp_path):
    """'up to 139 ticks' (performance.md's front-end tables: the pacer's late bursts) is checked
    against its files: packet_cost_decode_ring_cpu.json holds 139, not 138."""
    sentence = "The client was late on up to {} of a repeat."
    assert _unbacked_in_marked_line(tmp_path, "packet_cost_decode_ring_cpu.json", sentence, "139 ticks") == []
    assert _unbacked_in_marked_line(tmp_path, "packet_cost_decode_ring_cpu.json", sentence, "138 ticks") == [
        "x.md:2: 138 ticks (not in packet_cost_decode_ring_cpu.json)"]


def _unbacked_in_marked_line(tmp_path, result_file: str, sentence: str, figure: str) -> list[str]:
    """The checker's complaints about `sentence` with `figure` in it, under a mark naming `result_file`."""
    page = tmp_path / "x.md"
    page.write_text(f"<!-- figures: {result_file} -->\n{sentence.format(figure)}\n")
    return page_figures.unbacked(tmp_path, page_results.RESULTS, ["x.md"])


def test_a_measurement_beside_a_flag_is_checked_when_a_result_file_backs_its_line(tmp_path):
    """A flag on a line exempts its numbers (limits, defaults) only where no result file is named for
    them: under a figures mark, or in a row naming its result file, a figure copied wrong is named.
    ws_layer_cpu.json holds 22.5 (µs, picows with a task per frame), not 23.5; packet_cost_fastws2_cpu.json
    holds 101.2, not 99.9, and its command's `--streams 32` backs "32 streams"."""
    page = tmp_path / "x.md"
    results = page_results.RESULTS
    marked = "<!-- figures: ws_layer_cpu.json -->\nA frame to a task, as `--fast-ws-port` does: {} per packet.\n"
    row = "| `--fast-ws-port` | off | 32 streams: {} after (`packet_cost_fastws2_cpu.json`) |\n"
    page.write_text(marked.format("22.5 µs") + "\n" + row.format("101.2 µs"))
    assert page_figures.unbacked(tmp_path, results, ["x.md"]) == []
    page.write_text(marked.format("23.5 µs") + "\n" + row.format("99.9 µs"))
    assert page_figures.unbacked(tmp_path, results, ["x.md"]) == [
        "x.md:2: 23.5 µs (not in ws_layer_cpu.json)", "x.md:4: 99.9 µs (not in packet_cost_fastws2_cpu.json)"]
    page.write_text("| `--fast-ws-port` | off | 99.9 µs per packet |\n")  # a flag's row naming no file: a setting
    assert page_figures.unbacked(tmp_path, results, ["x.md"]) == []


def _client_versions(readme: str) -> dict[str, set[str]]:
    """package -> the versions README.md's client table says were tested."""
    table = readme.split("| client (version tested) |", 1)[1].split("\n\n", 1)[0]
    alias = {"riva.client": "nvidia-riva-client"}
    found: dict[str, set[str]] = {}
    for name, version in re.findall(r"`?([A-Za-z][\w.-]*)`?(?: SDK)? (\d+\.\d+(?:\.\d+)?)\b", table):
        found.setdefault(alias.get(name, name).lower(), set()).add(version)
    return found


def test_the_client_versions_in_the_readme_are_the_locks():
    """README.md's "client (version tested)" column names the versions CI installs: env/cpu.lock.txt,
    or env/nodeps.lock.txt for the two packages installed without dependencies."""
    lock = {}
    for name in ("cpu.lock.txt", "nodeps.lock.txt"):
        for line in (ROOT / "env" / name).read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                package, version = line.split("==")
                lock[package.strip().lower()] = version.strip()
    claimed = _client_versions(README.read_text())
    pinned = {p: v for p, v in claimed.items() if p in lock}
    assert {"openai", "websockets", "nvidia-riva-client", "livekit-plugins-openai", "livekit-plugins-nvidia"} <= set(pinned)
    assert {p: v for p, v in pinned.items() if v != {lock[p]}} == {}
    assert _client_versions("| client (version tested) |\n| `openai` SDK 3.56.0 |\n")["openai"] == {"3.56.0"}


def test_a_difference_in_points_must_be_a_difference_of_the_files_rates(tmp_path):
    """eou_demo_cpu.json: the EOU model's WER 0.0859 against the demo model's 0.0932 is 0.7 points
    (0.73); 0.4 points is no difference of its numbers."""
    sentence = "The WER target is beaten by {} at 80 ms."
    assert _unbacked_in_marked_line(tmp_path, "eou_demo_cpu.json", sentence, "0.7 points") == []
    assert _unbacked_in_marked_line(tmp_path, "eou_demo_cpu.json", sentence, "0.4 points") == [
        "x.md:2: 0.4 points (not in eou_demo_cpu.json)"]


def test_the_client_tables_whole_counts_are_every_bundled_utterance():
    """README's client rows say 24/24 (every bundled utterance equal to /ws), backed by the tests
    they name, which loop over a glob of the bundled files: a glob that found fewer (a moved or
    thinned folder) would let those loops pass on fewer files while the README still said 24/24."""
    from tests.helpers_riva import UTTERANCES

    table = README.read_text().split("| client (version tested) |", 1)[1].split("\n\n", 1)[0]
    whole = {int(b) for a, b in re.findall(r"(?<![\d/])(\d+)/(\d+)(?![\d/])", table) if a == b and int(b) > 8}
    assert whole == {24}, whole  # `Recognize` 8/8 is its own test's first eight
    assert len(UTTERANCES) == 24 == len(list((ROOT / "nemo_serve" / "assets" / "demo" / "utterances").glob("*.wav")))
