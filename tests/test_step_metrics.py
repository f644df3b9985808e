"""benchmarks/step_metrics.py: the server's step time by batch size, as sweep.py records it per
level and as sweep_plot.py and summarize.py read it over a whole sweep."""

from __future__ import annotations

from benchmarks.step_metrics import mean_step_ms_by_bin, step_time_by_batch


def _histogram(bins: dict[str, tuple[float, int]]) -> str:
    """Prometheus text for nemo_serve_step_duration_seconds: batch-size bin -> (sum s, count)."""
    lines = ["# HELP nemo_serve_step_duration_seconds step", "# TYPE nemo_serve_step_duration_seconds histogram"]
    for label, (total_s, count) in bins.items():
        lines.append(f'nemo_serve_step_duration_seconds_bucket{{batch_size="{label}",le="+Inf"}} {count}')
        lines.append(f'nemo_serve_step_duration_seconds_sum{{batch_size="{label}"}} {total_s}')
        lines.append(f'nemo_serve_step_duration_seconds_count{{batch_size="{label}"}} {count}')
    return "\n".join(lines) + "\n"


def test_one_level_is_the_difference_of_two_scrapes_in_bin_order():
    before = _histogram({"1": (0.5, 10), "9-16": (1.0, 4)})
    after = _histogram({"1": (0.8, 16), "9-16": (1.0, 4), "2-4": (0.2, 5)})
    # bin 1: 0.3 s over 6 steps = 50 ms; 2-4 new: 0.2 s over 5 = 40 ms; 9-16 ran no step: left out
    assert step_time_by_batch(before, after) == {"1": {"steps": 6, "mean_ms": 50.0}, "2-4": {"steps": 5, "mean_ms": 40.0}}


def test_a_sweep_mean_weights_each_level_by_its_steps():
    levels = [
        {"step_time_by_batch": {"17-32": {"steps": 1, "mean_ms": 90.0}, "1": {"steps": 3, "mean_ms": 10.0}}},
        {"step_time_by_batch": {"1": {"steps": 1, "mean_ms": 30.0}}},
        {"streams": 4},  # a level without the figure (an old result file)
    ]
    # bin 1: (3 x 10 + 1 x 30) / 4 = 15, not the unweighted 20; bins rise, not in insertion order
    assert list(mean_step_ms_by_bin(levels).items()) == [("1", 15.0), ("17-32", 90.0)]
