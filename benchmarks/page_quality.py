"""The tables of what the server's answers are worth under stress and by design: overload, the
hostile-input runs, the demo model's WER (docs/demo_model.md) and phrase boosting's benefit and cost."""

from __future__ import annotations

from benchmarks.page_results import fmt, model_label, read, run_info, shipped_sha, source

def _overload_runs(name: str) -> tuple[dict, dict]:
    runs = {r["max_queue_delay_s"]: r for r in read(name)["runs"]}
    return runs[0.0], next(r for d, r in runs.items() if d > 0)


def table_overload() -> str:
    """The overload table: off, on, and on without the re-admission cap (an older run)."""
    (off, on), (nocap_off, nocap) = _overload_runs("overload_demo_r13_cpu.json"), _overload_runs("overload_demo_r13_nocap_cpu.json")

    def lat(r, key):
        ms = r["level"][key]
        return f"{ms['p50'] / 1e3:.1f} / {ms['p95'] / 1e3:.1f} s"

    def cells(label, fn, with_off=""):
        third = fn(nocap) + (f" ({with_off}{fn(nocap_off)})" if with_off else "")
        return f"| {label} | {fn(off)} | {fn(on)} | {third} |"

    q = lambda r: r["level"]["quality"]  # noqa: E731
    rows = [f"| | off (`--max-queue-delay-s 0`) | on ({on['max_queue_delay_s']:g} s, gradual re-admission) | on, without the cap (`_nocap`) |",
            "|---|---|---|---|",
            cells("items admitted / attempts refused", lambda r: f"{r['streams_admitted']:,} / {r['streams_refused']:,}"),
            cells("model behind real time, at most", lambda r: f"{max(x[1] for x in r['readyz'] if x[1] is not None):.1f} s"),
            cells("partial latency p50 / p95", lambda r: lat(r, "partial_latency_ms"), "off in that run: "),
            cells("final latency p50 / p95", lambda r: lat(r, "final_latency_ms"), "off: "),
            cells("audio completed in the run", lambda r: f"{r['level']['audio_s_completed']:,.0f} s", "off: "),
            cells("token-identical to NeMo's loop", lambda r: f"{q(r)['token_identical_streams']}/{q(r)['streams_compared']}", "off: ")]
    names = ["overload_demo_r13_cpu.json", "overload_demo_r13_nocap_cpu.json"]
    return "\n".join(rows) + source(names, [run_info(read(n)) for n in names])


FUZZ_FILES = ("fuzz_server_tiny-hybrid.json", "fuzz_server_demo_r3.json")


def table_fuzz() -> str:
    """docs/performance.md's hostile-input runs of benchmarks/fuzz_server.py against the real server."""
    rows = ["| date, commit, model | fuzzed messages (cases), bytes | crashes | abnormal closes, hangs | connect/abort cycles "
            "| slots leaked | RSS before -> after | drain | log |", "|---|---|---|---|---|---|---|---|---|"]
    closes = []
    for name in FUZZ_FILES:
        d, info = read(name), run_info(read(name))
        f, dr = d["fuzz"], d["drain"]
        ends = sum(1 for e in dr["stream_ends"] if e[:2] == ["done", "draining"])
        rows.append(f"| {info['date']}, {info['commit']}, {d['model']} | {f['messages']:,} ({f['cases']:,}), {f['bytes_sent'] / 1e9:.2f} GB "
                    f"| {f['crashes']} | {f['abnormal']}, {f['hangs']} | {d['abort_cycles']:,} | {d['slots_leaked']} "
                    f"| {d['rss_mb_before']:.0f} -> {d['rss_mb_after']:.0f} MB | {dr['drain_s']:.2f} s, exit {dr['exit_code']}, "
                    f"{ends}/{dr['streams']} `done` `draining` | {d['log_lines']:,} lines, {d['log_bytes'] / 1e3:.0f} kB, "
                    f"{d['log_tracebacks']} tracebacks |")
        by_code = ", ".join(f"{n:,} x {c}" for c, n in sorted(f["closes"].items(), key=lambda kv: -kv[1]))
        closes.append(f"{d['model']}: closes {by_code}; {sum(f['refused'].values()):,} handshakes refused (503, slots taken)")
    rows.append("\n" + "; ".join(closes) + ".")
    seg = read("fuzz_server_demo_r3.json")["long_segment"]
    rows.append(f"\nA {seg['seconds'] / 60:.0f}-minute segment (demo model, endpointing off) sent {seg['bytes_sent'] / 1e6:.2f} MB "
                f"in {seg['partials']:,} partials (largest {seg['largest_partial_bytes'] / 1e3:.1f} kB), where whole-segment partials "
                f"would have come to {seg['bytes_with_whole_segment_partials'] / 1e6:.1f} MB: past 256 tokens a partial carries only what is new.")
    return "\n".join(rows) + source(list(FUZZ_FILES), [run_info(read(n)) for n in FUZZ_FILES])


def table_demo_wer() -> str:
    d = read("demo_wer_accented_avg3_cpu.json")
    same = "the shipped `demo.nemo`" if d.get("model_sha256") == shipped_sha() else f"weights {d.get('model_sha256', '?')[:7]}"
    missed = "".join(f"\n- missed: {m}" for m in d.get("missed", []))
    return (d["table"] + f"\n\nWER of NeMo's cache-aware loop, first {d['limit']} utterances per set, {same}; bold: within "
            f"the {100 * d['target']['wer']:.0f}% target.{missed}" + source(["demo_wer_accented_avg3_cpu.json"], [run_info(d)]))


def table_boost_benefit() -> str:
    name = "phrase_boost_benefit_demo_r13_cpu.json"
    d = read(name)
    rows = ["| boost | term error rate | WER, utterances with a term | false alarms | WER, utterances without |",
            "|---|---|---|---|---|"]
    for r in d["results"]:
        boost = "no phrases" if r["boost"] is None else f"{r['boost']:g}"
        rows.append(f"| {boost} | {r['term_error_rate']:.3f} | {r['wer_positive']:.3f} | {r['false_alarm_rate']:.3f} "
                    f"({len(r['false_alarms'])}/{r['negatives']}) | {r['wer_negative']:.3f} |")
    first = d["results"][0]
    note = (f"\n\n{first['terms_spoken']} utterances of {len(d['terms'])} terms ({', '.join(d['voices'])}), "
            f"{first['negatives']} without; every stream sends all {d['phrases_per_stream']} terms as its phrases.")
    return "\n".join(rows) + note + source([name], [run_info(d)])


def table_boost_cost() -> str:
    name = "step_demo_r13_boost_cpu_fp32.json"
    d = read(name)
    by = {(r["system"], r["batch"]): r for r in d["results"]}
    rows = ["| batch | engine | one stream boosted | every stream boosted | cost, one / every |", "|---|---|---|---|---|"]
    for b in sorted({r["batch"] for r in d["results"]}):
        ratios = d["ratios_cpu_time"][str(b)]
        cells = [fmt(by[(s, b)]["stream_steps_per_cpu_s"], 1) for s in ("engine", "engine-boost1", "engine-boostall")]
        cost = [f"{100 * (ratios[f'engine_over_{s}'] - 1):+.0f}%" for s in ("engine-boost1", "engine-boostall")]
        rows.append(f"| {b} | " + " | ".join(cells) + f" | {cost[0]} / {cost[1]} |")
    note = (f"\n\nStream-steps per CPU second, {model_label(d)} {d['chunk_ms']:.0f} ms, {d['dtype']}, one thread, "
            f"median of {d['rounds']} interleaved rounds; cost: the median per-round ratio engine / boosted, minus 1.")
    return "\n".join(rows) + note + source([name], [run_info(d)])
