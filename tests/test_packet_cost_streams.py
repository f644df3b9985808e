"""benchmarks/packet_cost_streams.py's verdicts (issue 48): a level counts toward the 25 µs target
only when it is valid; a level whose load generator broke is an invalid row, not a crashed run."""

from types import SimpleNamespace

from benchmarks import packet_cost_streams
from benchmarks.packet_cost_table import _first_met, _streams_cell


def _row(streams: int, us: float, verdict: str = "keeps_up") -> dict:
    return {"streams": streams, "us_per_packet_all_in": us, "verdict": verdict, "valid": verdict == "keeps_up",
            "send_lateness_ms": {"p99": 3.0}}  # fmt: skip


def test_the_target_is_met_only_at_a_valid_level():
    assert _first_met([_row(32, 60.0), _row(256, 20.0)], 25) == "met at 256 streams"
    late = _first_met([_row(32, 60.0), _row(256, 10.0, "generator_late")], 25)
    assert late.startswith("**missed** at every valid level (the largest: 32 streams)")
    assert "under it from 256 streams in invalid runs" in late
    assert _first_met([_row(64, 10.0, "server_behind")], 25).startswith("no valid level")


def test_a_level_whose_generator_broke_is_an_invalid_row(monkeypatch):
    def broken(*args):
        raise AttributeError("'NoneType' object has no attribute 'early'")

    monkeypatch.setattr(packet_cost_streams, "measure", broken)
    row = packet_cost_streams.measure_or_error(SimpleNamespace(), [1], 0.0, "realtime_picows", 512, None)
    assert row["verdict"] == "error" and row["valid"] is False and "early" in row["error"]
    assert _streams_cell(row) == "the load generator failed (invalid)"
    assert _first_met([_row(32, 60.0), row], 25).startswith("**missed**")


def test_the_blast_table_says_the_top_level_is_not_shown_unless_every_run_of_it_was_valid():
    from benchmarks.packet_cost_table import _at_top

    assert _at_top([_row(256, 20.0), _row(1000, 12.0), _row(1000, 11.0)], 25) == "met at 1,000 streams"
    assert _at_top([_row(1000, 12.0), _row(1000, 11.0, "core_behind")], 25).startswith("**not shown** at 1,000")
    assert _at_top([_row(1000, 30.0), _row(1000, 20.0)], 25) == "**missed** at 1,000 streams"


def test_the_realtime24k_table_words_the_target_by_the_median_of_the_valid_runs():
    """One run within 25 µs among runs over it is this machine's spread, not the target met."""
    from benchmarks.packet_cost_table import _by_median

    assert _by_median([24.3, 35.0, 26.0], 25).startswith("**missed** by the median; 1 of 3")
    assert _by_median([24.7, 20.6], 25).startswith("met by the median; 2 of 2")
    assert _by_median([], 25) == "no valid run"
