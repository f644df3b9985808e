"""Does malloc_trim stop a front end's RSS growing under the soak? The same churn with the trim off and on.

    nice -n 5 python -m benchmarks.soak_trim --minutes 6 --out benchmarks/results/soak_trim_cpu.json

runs benchmarks/soak.py `--rounds` times per arm, the arms alternating (off, on, off, on, ...) so
that the machine's load falls on both: `--heap-trim-period-s 0` against `--period-s` (the server's
default, 60). Each run carries benchmarks/tracemalloc_probe without tracing (frames 0), which
records glibc's heap in use and the free memory it keeps (mallinfo2) in each front end every
`--probe-every-s` from `--baseline-s` after it is up. The JSON holds each run's soak report, its
front ends' probe records, and per arm the front ends' RSS slope over the second half and their
first/second-half maxima, over the churn alone; `bound_mib_per_hour` is the steepest front-end
growth with the trim on (slope, first- to second-half maximum, or slope of the per-minute minima),
times 60. `--from-runs` summarises
an earlier file's runs again (its own run record kept as `measured_by`). A PNG beside the JSON plots the front ends' RSS of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import soak  # noqa: E402

PROBE = Path(__file__).resolve().parent / "tracemalloc_probe"


def one_run(minutes: float, period_s: float, baseline_s: float, probe_every_s: float) -> dict:
    probe_dir = tempfile.mkdtemp(prefix="soak-trim-probe-")
    os.environ.update(TRACEMALLOC_PROBE_DIR=probe_dir, TRACEMALLOC_PROBE_BASELINE_S=str(baseline_s),
                      TRACEMALLOC_PROBE_FRAMES="0", TRACEMALLOC_PROBE_EVERY_S=str(probe_every_s))  # fmt: skip
    soak_out = Path(probe_dir) / "soak.json"
    code = soak.main(["--minutes", str(minutes), "--heap-trim-period-s", str(period_s), "--out", str(soak_out)])
    report = json.loads(soak_out.read_text())
    probes = {f.stem: json.loads(f.read_text()) for f in sorted(Path(probe_dir).glob("[0-9]*.json"))}
    frontend_pids = {str(pid): role for role, pid in report["processes"].items() if role.startswith("frontend")}
    return {"exit_code": code, "soak": report,
            "malloc": {frontend_pids.get(pid, pid): {"malloc_kib": r["malloc_kib"], "malloc_series": r.get("malloc_series")}
                       for pid, r in probes.items()}}  # fmt: skip


def churn_summaries(run: dict) -> list[dict]:
    """Each front end's RSS figures (soak.summarize_series) over the churn alone: the soak's last
    sample, taken after the churn once every slot is free, is left out. Idle, a front end gives
    back about a MiB (free() trims the heap's top), which in the soak's own summary pulls the
    second half's slope down under both arms."""
    end_s = run["soak"]["minutes"] * 60
    return [soak.summarize_series([s for s in series if s[0] <= end_s])
            for role, series in sorted(run["soak"]["rss_mib"].items()) if role.startswith("frontend")]  # fmt: skip


def floor_slopes(run: dict, window_s: float = 60.0, warmup_s: float = 120.0) -> list[float]:
    """Each front end's slope (MiB/min) through its per-minute minima after the warm-up: with the trim
    on, RSS is a saw (a trim gives back, the churn faults pages in again), and its floor is what
    would grow if something were kept."""
    end_s, slopes = run["soak"]["minutes"] * 60, []
    for role, series in sorted(run["soak"]["rss_mib"].items()):
        if not role.startswith("frontend"):
            continue
        windows: dict[int, float] = {}
        for t, mib in series:
            if warmup_s <= t <= end_s:
                key = int(t // window_s)
                windows[key] = min(mib, windows.get(key, mib))
        keys = sorted(windows)
        slopes.append(round(float(np.polyfit([k * window_s / 60 for k in keys], [windows[k] for k in keys], 1)[0]), 3)
                      if len(keys) >= 3 else None)  # fmt: skip
    return slopes


def arm_summary(runs: list[dict]) -> dict:
    """The front ends' RSS figures over every run of one arm, and mallinfo2's free memory kept at the end."""
    fronts = [r for run in runs for r in churn_summaries(run)]
    slopes = [r["second_half_slope_mib_per_min"] for r in fronts]
    half_minutes = runs[0]["soak"]["minutes"] / 2
    max_growth = [round((r["second_half_max_mib"] - r["first_half_max_mib"]) / half_minutes, 3) for r in fronts]
    free_kept = [m["malloc_kib"]["now"].get("free_held") for run in runs for m in run["malloc"].values()]
    return {
        "frontend_slopes_mib_per_min": slopes,
        "frontend_first_half_max_mib": [r["first_half_max_mib"] for r in fronts],
        "frontend_second_half_max_mib": [r["second_half_max_mib"] for r in fronts],
        # first- to second-half maximum, per minute between the halves' middles
        "frontend_max_growth_mib_per_min": max_growth,
        "frontend_floor_slopes_mib_per_min": [x for run in runs for x in floor_slopes(run)],
        "frontend_free_kept_kib_at_end": free_kept,
        "steepest_slope_mib_per_hour": round(max(slopes) * 60, 1),
        "steepest_max_growth_mib_per_hour": round(max(max_growth) * 60, 1),
        "steepest_floor_slope_mib_per_hour": round(max(x for run in runs for x in floor_slopes(run) if x is not None) * 60, 1)
        if any(x is not None for run in runs for x in floor_slopes(run)) else None,
        "streams": sum(run["soak"]["num_streams"] for run in runs),
        # only these are compared with the quiet run; the dropped, aborted and closed-early are not
        "streams_ended": sum(run["soak"]["streams_total"].get("ended", 0) for run in runs),
        "mismatches": sum(run["soak"]["num_mismatches"] for run in runs),
        "all_slots_free_at_end": all(run["soak"]["slots_free_at_end"] for run in runs),
    }


def plot(report: dict, path: Path) -> None:
    """Each run's front ends' RSS over time, trim off in one colour and on in another."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for arm, colour in (("off", "tab:red"), ("on", "tab:blue")):
        for i, run in enumerate(report["runs"][arm]):
            for role, series in run["soak"]["rss_mib"].items():
                if role.startswith("frontend"):
                    label = f"trim {arm}" if i == 0 and role == "frontend0" else None
                    ax.plot([t / 60 for t, _ in series], [m for _, m in series], color=colour, lw=0.8, label=label)
    ax.set_xlabel("minutes")
    ax.set_ylabel("front-end RSS (MiB)")
    ax.legend(fontsize=8)
    ax.set_title(f"soak: front ends with malloc_trim every {report['period_s']:g} s or none", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=6.0, help="per run")
    p.add_argument("--rounds", type=int, default=1, help="runs per arm")
    p.add_argument("--period-s", type=float, default=60.0, help="--heap-trim-period-s of the 'on' arm")
    p.add_argument("--baseline-s", type=float, default=60.0, help="the probe's first mallinfo2 reading, after a front end is up")
    p.add_argument("--probe-every-s", type=float, default=20.0)
    p.add_argument("--from-runs", metavar="FILE", help="summarise the runs of an earlier --out again, without running")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.from_runs:
        earlier = json.loads(Path(args.from_runs).read_text())
        # the measurement's own record, also when the file was summarised again before
        return report_and_print(args, earlier["runs"], {"measured_by": earlier.get("measured_by", earlier["run"])})
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(PROBE)]))
    arms: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for arm, period_s in (("off", 0.0), ("on", args.period_s)):
            arms[arm].append(one_run(args.minutes, period_s, args.baseline_s, args.probe_every_s))
    return report_and_print(args, arms, {})


def report_and_print(args, arms: dict[str, list[dict]], extra: dict) -> int:
    from benchmarks.common import run_record

    summary = {arm: arm_summary(runs) for arm, runs in arms.items()}
    on = summary["on"]
    bound = max(x for k, x in on.items() if k.startswith("steepest_") and x is not None)
    minutes, period_s = arms["on"][0]["soak"]["minutes"], arms["on"][0]["soak"]["heap_trim_period_s"]
    report = {"run": run_record(), **extra, "minutes": minutes, "period_s": period_s, "summary": summary,
              "bound_mib_per_hour": bound, "runs": arms}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    plot(report, Path(args.out).with_suffix(".png"))
    for arm, s in summary.items():
        print(f"trim {arm:3s}: front-end slopes {s['frontend_slopes_mib_per_min']} MiB/min, first/second-half max "
              f"{s['frontend_first_half_max_mib']} / {s['frontend_second_half_max_mib']} MiB, floor slopes "
              f"{s['frontend_floor_slopes_mib_per_min']} MiB/min, free kept at end "
              f"{s['frontend_free_kept_kib_at_end']} KiB, {s['streams']} streams, {s['mismatches']} mismatches")  # fmt: skip
    return max(run["exit_code"] for runs in arms.values() for run in runs)


if __name__ == "__main__":
    sys.exit(main())
