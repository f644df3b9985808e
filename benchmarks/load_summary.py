"""One load level's summary: latency percentiles, drift, quality against the oracle, and the
DESIGN's keeps-up verdict, from the StreamRecords load_level.run_level collected."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from benchmarks.common import percentiles
from benchmarks.load_items import LoadItem
from benchmarks.load_level import StreamRecord
from nemo_serve.scoring import edit_distance

DRIFT_MIN_PARTIALS = 4
DRIFT_MIN_SPAN_S = 3.0


def drift_slope_ms_per_s(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of latency (ms) against audio position (s); None if too short to tell."""
    if len(points) < DRIFT_MIN_PARTIALS:
        return None
    x = np.array([p for p, _ in points])
    if x.max() - x.min() < DRIFT_MIN_SPAN_S:
        return None
    y = 1000.0 * np.array([lat for _, lat in points])
    return float(np.polyfit(x, y, 1)[0])


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w' ]+", " ", text.lower()).split()


def summarise_level(records: list[StreamRecord], items: list[LoadItem], num_streams: int, duration_s: float) -> dict:
    by_id = {it.item_id: it for it in items}
    ok = [r for r in records if r.error is None]
    partial = [lat for r in ok for _, lat in r.partial_latencies()]
    final = [r.final_latency for r in ok if r.final_latency is not None]
    server = [sent - arrival for r in ok for _, _, arrival, sent in r.partials]
    slopes = [s for s in (drift_slope_ms_per_s(r.partial_latencies()) for r in ok) if s is not None]
    errors = Counter(r.error.split(":")[0] if r.error.startswith(("refused", "connect", "error")) else r.error for r in records if r.error)
    out = {
        "streams": num_streams,
        "duration_s": duration_s,
        "items_started": len(records),
        "items_completed": len(ok),
        "errors": dict(errors),
        "error_examples": sorted({r.error for r in records if r.error})[:5],
        "audio_s_completed": round(sum(r.audio_s for r in ok), 1),
        "partial_latency_ms": _ms(percentiles(partial)),
        "final_latency_ms": _ms(percentiles(final)),
        "server_partial_latency_ms": _ms(percentiles(server)),
        "drift_ms_per_s": {
            "median": float(np.median(slopes)) if slopes else None,
            "p90": float(np.percentile(slopes, 90)) if slopes else None,
            "streams_measured": len(slopes),
        },
        "num_partials": len(partial),
        "quality": _quality(ok, by_id),
    }
    return out


def _ms(p: dict) -> dict:
    return {k: (round(1000 * v, 1) if v is not None else None) for k, v in p.items()}


def _quality(ok: list[StreamRecord], by_id: dict) -> dict:
    q: dict = {}
    with_oracle = [r for r in ok if by_id[r.item_id].oracle is not None]
    if with_oracle:
        ref = sum(len(by_id[r.item_id].oracle) for r in with_oracle)
        err = sum(edit_distance(r.token_ids, by_id[r.item_id].oracle) for r in with_oracle)
        q["token_identical_streams"] = sum(r.token_ids == by_id[r.item_id].oracle for r in with_oracle)
        q["streams_compared"] = len(with_oracle)
        q["token_error_rate_vs_oracle"] = err / max(ref, 1)
    with_text = [r for r in ok if by_id[r.item_id].text]
    if with_text:
        ref_words = sum(len(_words(by_id[r.item_id].text)) for r in with_text)
        err = sum(edit_distance(_words(r.text), _words(by_id[r.item_id].text)) for r in with_text)
        q["wer"] = err / max(ref_words, 1)
    return q


def keeps_up(level: dict, chunk_ms: float, max_drift_ms_per_s: float = 20.0) -> bool:
    """The DESIGN's criterion: p95 partial latency within two chunk periods, no stream drifting
    (the 90th percentile of the per-stream latency slopes within `max_drift_ms_per_s`: a median
    alone hides the tenth of the streams that fall behind), every stream completed, none refused."""
    p95 = level["partial_latency_ms"]["p95"]
    drift = level["drift_ms_per_s"]["p90"]
    return (
        p95 is not None and p95 <= 2 * chunk_ms
        and drift is not None and drift <= max_drift_ms_per_s
        and not level["errors"] and level["items_completed"] > 0
    )


def format_level(level: dict) -> str:
    p, f, d = level["partial_latency_ms"], level["final_latency_ms"], level["drift_ms_per_s"]
    q = level["quality"]
    quality = ""
    if "token_identical_streams" in q:
        quality = f", oracle-identical {q['token_identical_streams']}/{q['streams_compared']}"
    if "wer" in q:
        quality += f", WER {100 * q['wer']:.1f}%"
    return (
        f"N={level['streams']}: partial p50/p95/p99 {p['p50']}/{p['p95']}/{p['p99']} ms, "
        f"final p50/p95 {f['p50']}/{f['p95']} ms, drift median/p90 {_round(d['median'])}/{_round(d['p90'])} ms/s, "
        f"completed {level['items_completed']}/{level['items_started']}, errors {level['errors'] or 0}{quality}"
        f" -> {_verdict_words(level)}"
    )


def _verdict_words(level: dict) -> str:
    if level.get("verdict") == "generator_late":
        return "INVALID: the load generator fell behind"
    return "keeps up" if level.get("keeps_up") else "BEHIND"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)
