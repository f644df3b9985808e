"""The server's step time by batch size, read from its Prometheus histogram
(nemo_serve_step_duration_seconds) before and after a level."""

from __future__ import annotations


def step_histogram(text: str) -> dict[str, tuple[float, float]]:
    """batch-size bin -> (sum of step seconds, count) from nemo_serve_step_duration_seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "nemo_serve_step_duration_seconds":
            continue
        for s in fam.samples:
            b = s.labels.get("batch_size")
            if s.name.endswith("_sum"):
                out.setdefault(b, [0.0, 0.0])[0] = s.value
            elif s.name.endswith("_count"):
                out.setdefault(b, [0.0, 0.0])[1] = s.value
    return {b: (v[0], v[1]) for b, v in out.items()}


def step_time_by_batch(before: str, after: str) -> dict[str, dict]:
    """Mean step time and step count per batch-size bin over one level."""
    a, b = step_histogram(before), step_histogram(after)
    out = {}
    for label, (s1, c1) in b.items():
        s0, c0 = a.get(label, (0.0, 0.0))
        if c1 - c0 > 0:
            out[label] = {"steps": int(c1 - c0), "mean_ms": round(1000 * (s1 - s0) / (c1 - c0), 2)}
    return dict(sorted(out.items(), key=lambda kv: bin_lo(kv[0])))


def bin_lo(label: str) -> int:
    return int(label.split("-")[0])



def mean_step_ms_by_bin(levels: list[dict]) -> dict[str, float]:
    """Mean step time per batch-size bin over all of a sweep's levels (each level's mean weighted
    by its step count), bins in rising order."""
    by_bin: dict[str, list[float]] = {}
    for level in levels:
        for label, s in level.get("step_time_by_batch", {}).items():
            total = by_bin.setdefault(label, [0.0, 0.0])
            total[0] += s["mean_ms"] * s["steps"]
            total[1] += s["steps"]
    return {label: by_bin[label][0] / by_bin[label][1] for label in sorted(by_bin, key=bin_lo)}
