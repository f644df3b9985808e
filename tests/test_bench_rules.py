"""The load benchmarks' keep-up rule: the numbers in docs/performance.md depend on it."""

import pytest

from benchmarks.load_summary import keeps_up


def level(p95_ms: float, drift_median: float, drift_p90: float, errors: dict | None = None) -> dict:
    return {
        "partial_latency_ms": {"p50": p95_ms / 2, "p95": p95_ms, "p99": p95_ms},
        "drift_ms_per_s": {"median": drift_median, "p90": drift_p90, "streams_measured": 64},
        "errors": errors or {},
        "items_completed": 64,
    }


def test_a_steady_level_keeps_up():
    assert keeps_up(level(588.0, -0.4, 4.0), chunk_ms=320.0)


def test_p95_beyond_two_chunk_periods_is_behind_whatever_the_drift():
    # The committed 320 ms sweep's N=64 level: p95 2,968 ms with a median drift of -8.9 ms/s.
    assert not keeps_up(level(2968.1, -8.9, 4.1), chunk_ms=320.0)
    assert keeps_up(level(2200.0, 0.0, 1.0), chunk_ms=1120.0)


def test_a_tenth_of_the_streams_drifting_is_behind_even_with_a_flat_median():
    # The committed 320 ms sweep's N=96 level: median -0.4 ms/s, p90 24.5 ms/s.
    assert not keeps_up(level(588.1, -0.4, 24.5), chunk_ms=320.0)


def test_refused_streams_are_behind():
    assert not keeps_up(level(100.0, 0.0, 1.0, errors={"refused": 1}), chunk_ms=320.0)


def test_a_result_file_does_not_make_its_own_run_dirty(tmp_path, monkeypatch):
    """`git_dirty` says whether the code that ran differs from its commit: a results file the run (or an
    earlier one) wrote must not count, an edited source file must."""
    import subprocess

    import benchmarks.common as common

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    (tmp_path / "nemo_serve").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "nemo_serve" / "x.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "b.py").write_text("b = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "init")
    monkeypatch.setattr(common, "REPO", tmp_path)
    (tmp_path / "benchmarks" / "results" / "new.json").write_text("{}")
    clean = common.run_record()
    assert clean["git_dirty"] is False and clean["git_dirty_files"] == []
    (tmp_path / "benchmarks" / "b.py").write_text("b = 2\n")
    (tmp_path / "nemo_serve" / "new.py").write_text("n = 1\n")
    dirty = common.run_record()
    # which files differed is kept, so a dirty result still says what code ran (not the results folder)
    assert dirty["git_dirty"] is True and sorted(dirty["git_dirty_files"]) == ["benchmarks/b.py", "nemo_serve/new.py"]


def test_kernel_count_splits_ops_by_phase_for_both_kernel_scripts():
    """benchmarks/kernel_count.count, which decoder_kernel_count.py now uses too: an op counts in
    every counted phase around it (attention inside the encoder counts in both), a phase the
    caller does not count is passed through (its ops go to the counted phase around it, or to
    "rest"), views are not kernels, and the total is every op once."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks import kernel_count

    x = torch.ones(4, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("phase:encoder"):
            y = torch.relu(x)
            with record_function("phase:attention"):
                z = torch.neg(y)
        with record_function("phase:decoder"):
            w = y.view(16)
            with record_function("phase:other"):
                w = torch.abs(w)
        torch.exp(z)
    both = kernel_count.count(prof)
    two = kernel_count.count(prof, ("encoder", "decoder"))
    leaf = {p: c["leaf_ops"] for p, c in both.items()}
    assert leaf == {"encoder": 2, "attention": 1, "decoder": 1, "rest": 1, "total": 4}, both
    assert {p: c["leaf_ops"] for p, c in two.items()} == {"encoder": 2, "decoder": 1, "rest": 1, "total": 4}, two
    assert two["decoder"]["top_level_ops"] == 2 and two["decoder"]["aten_ops"] > two["decoder"]["leaf_ops"]  # view, abs


def test_a_dirty_result_names_its_changed_files_under_the_tables():
    """A result whose run had uncommitted code says which files under its table; an older one that
    recorded only the flag says "(dirty)"."""
    from benchmarks import page_results

    stamped = {"git_commit": "abc1234", "git_dirty": True, "git_dirty_files": ["nemo_serve/engine/step.py"]}
    assert page_results.run_info(stamped)["commit"] == "abc1234 (dirty: nemo_serve/engine/step.py)"
    assert page_results.run_info({"git_commit": "abc1234", "git_dirty": True})["commit"] == "abc1234 (dirty)"
    assert page_results.run_info({"git_commit": "abc1234", "git_dirty": False, "git_dirty_files": []})["commit"] == "abc1234"


def test_eou_bench_turn_end_counts_a_missed_eou_at_its_silence_rule_fallback():
    """benchmarks/eou_bench.py: a turn with an EOU after the last word ends at it; a turn whose EOU
    came early (or never) ends where the silence rule's final came, not nowhere (the EOU columns'
    percentiles leave such turns out, so docs/performance.md needs this one for 'every turn')."""
    from types import SimpleNamespace as F

    from benchmarks.eou_bench import eou_outcome, turn_end_latency

    end_s = 2.0
    eou_at_end = [F(end_reason="eou", eou_time_s=2.08, audio_processed_s=2.24, text="hello there")]
    assert turn_end_latency(eou_at_end, end_s) == pytest.approx(0.24)
    early_then_silence = [F(end_reason="eou", eou_time_s=1.0, audio_processed_s=1.12, text="hello"),
                          F(end_reason="silence", eou_time_s=None, audio_processed_s=3.28, text="there")]
    assert eou_outcome(early_then_silence, end_s) == (None, True)  # missed, and an early cut
    assert turn_end_latency(early_then_silence, end_s) == pytest.approx(1.28)
    never = [F(end_reason="end_of_input", eou_time_s=None, audio_processed_s=5.0, text="hello there")]
    assert turn_end_latency(never, end_s) is None


def test_eou_turns_bench_counts_each_turns_eou_finals_in_its_own_span():
    """benchmarks/eou_turns_bench.py: an `eou` final belongs to the turn whose span (its audio and the
    gap after it) holds its eou_time; a turn with two is split, one with none was not ended by the
    model, and other endings do not count."""
    from types import SimpleNamespace as F

    from benchmarks.eou_turns_bench import eou_per_turn

    turns = [2.0, 3.0, 1.5]  # spans with a 1 s gap: [0, 3), [3, 7), [7, end)
    finals = [F(end_reason="eou", eou_time_s=2.4), F(end_reason="eou", eou_time_s=3.0),  # turn 0's gap; turn 1's start
              F(end_reason="eou", eou_time_s=6.9), F(end_reason="silence", eou_time_s=None),
              F(end_reason="eou", eou_time_s=10.0)]  # past the last turn's gap (9.5 s): still the last turn's
    assert eou_per_turn(turns, 1.0, finals) == [1, 2, 1]
    assert eou_per_turn(turns, 1.0, finals[:1]) == [1, 0, 0]
