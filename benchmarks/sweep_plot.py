"""sweep.py's figure: latency and drift against the number of streams, and the server's step
time against batch size (beside a step_bench run's, when given)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.step_metrics import bin_lo, mean_step_ms_by_bin


def plot(result: dict, png: Path, step_bench: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = result["levels"]
    n = [x["streams"] for x in lv]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, style in (("p50", "-o"), ("p95", "-s"), ("p99", "-^")):
        ax[0].plot(n, [x["partial_latency_ms"][key] for x in lv], style, label=f"partial {key}")
    ax[0].plot(n, [x["final_latency_ms"]["p95"] for x in lv], "--d", label="final p95")
    ax[0].set(xlabel="concurrent streams N", ylabel="latency (ms)", yscale="log", title="latency")
    ax[0].legend(fontsize=8)
    drift = [x["drift_ms_per_s"]["p90"] for x in lv]
    colors = ["tab:green" if x["keeps_up"] else "tab:red" for x in lv]
    ax[1].bar([str(v) for v in n], [d if d is not None else 0 for d in drift], color=colors)
    ax[1].axhline(result["max_drift_ms_per_s"], color="grey", ls="--", lw=1, label="keeps-up threshold")
    ax[1].set(xlabel="concurrent streams N", ylabel="p90 drift over streams (ms of latency per s of audio)", title="drift")
    ax[1].legend(fontsize=8)
    _plot_steps(ax[2], lv, step_bench)
    fig.suptitle(
        f"{result['model']} {result['chunk_ms']:.0f} ms {result['dtype']} on {result['device']} "
        f"({result['server_threads']} thread(s)): kept up at N={result['capacity']['streams_kept_up']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _plot_steps(ax, levels: list[dict], step_bench: dict | None) -> None:
    mean_ms = mean_step_ms_by_bin(levels)
    xs = [(bin_lo(b) + int(b.split("-")[-1])) / 2 for b in mean_ms]
    ax.plot(xs, list(mean_ms.values()), "-o", label="server (mean per batch bin)")
    if step_bench:
        for system in ("engine", "pipeline", "sherpa", "loop"):
            rows = sorted((r["batch"], r["step_ms_median"]) for r in step_bench["results"] if r["system"] == system)
            if rows:
                ax.plot(*zip(*rows), "--x", label=f"step_bench {system}")
    ax.set(xlabel="batch size", ylabel="step time (ms)", title="step time vs batch size")
    ax.legend(fontsize=8)

