#!/usr/bin/env python3
"""Runs bench/variants_bench (the AttentionOptions variants against plain attention, 1 and 2 threads) and
the peak memory of a sliding-window forward, checks the attention-variant targets, and writes the
"Attention variants" section of bench/RESULTS.md (between its markers; the rest of the file is kept) and
bench/window.png (time against sequence length, sliding window and full attention).

    /usr/bin/python3 scripts/run_variant_benchmarks.py [--build] [--repetitions 5]

Needs Google Benchmark (libbenchmark-dev) and matplotlib (python3-matplotlib) for the plot.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- variants:begin -->", "<!-- variants:end -->"


from benchlib import build_benchmarks, load as _load, replace_section, run, times  # noqa: E402


def load(path):
    """name -> list of real times in ms, one per repetition."""
    runs, context = _load(path)
    return times(runs), context


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="store_true", help="configure and build variants_bench first")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--filter", default="variants/")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "RESULTS.md"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "bench", "window.png"))
    args = ap.parse_args()
    build = os.path.abspath(args.build_dir)
    if args.build:
        build_benchmarks(ROOT, build, ["variants_bench"])
    exe = os.path.join(build, "bench", "variants_bench")
    out_json = os.path.join(build, "variants_bench.json")
    bench_cmd = [exe, f"--benchmark_filter={args.filter}", f"--benchmark_repetitions={args.repetitions}",
                 "--benchmark_min_time=0.5", f"--benchmark_out={out_json}", "--benchmark_out_format=json"]
    run(bench_cmd, stdout=subprocess.DEVNULL)
    rss = {}
    for case in ("window", "plain"):
        out = run([exe, "--peak_rss", case, "16384"], capture_output=True, text=True).stdout
        rss[case] = json.loads(out)["vm_hwm_mib"]
    times, context = load(out_json)

    def t(name, stat=statistics.median):
        return stat(times[name])

    def key(group, case, n, threads, batch=None):
        return f"variants/{group}/{case}/N:{n}" + (f"/batch:{batch}" if batch else "") + f"/threads:{threads}"

    lines = [BEGIN, "## Attention variants (AttentionOptions)", ""]
    lines.append("Command: `/usr/bin/python3 scripts/run_variant_benchmarks.py --build` (which runs `"
                 + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in bench_cmd[:4])
                 + "`), on " + context.get("host_name", "this machine") + ", " + context.get("date", "") +
                 f". d_model 512, h 8, d_k = d_v = 64, float, eval. Times: min / median of {args.repetitions} runs.")
    lines += ["", "| case | threads | time (min / median) | vs plain | GFLOP/s (median) |", "|---|---|---|---|---|"]
    gflop = {}
    with open(out_json) as f:
        for b in json.load(f)["benchmarks"]:
            if b.get("run_type") != "aggregate":
                gflop[re.sub(r"/process_time/real_time$", "", b["run_name"])] = b.get("GFLOP", 0)

    def row(label, name, base, threads):
        ms_min, ms_med = t(name, min), t(name)
        ratio = ms_med / t(base) if base else None
        rate = gflop.get(name, 0) / (ms_med / 1e3)
        lines.append(f"| {label} | {threads} | {ms_min:.0f} / {ms_med:.0f} ms | "
                     f"{'%.2fx' % ratio if ratio else ''} | {rate:.0f} |")

    for threads in (1, 2):
        base = key("long", "plain", 4096, threads)
        row("1x4096 plain", base, None, threads)
        row("1x4096 `causal = true`", key("long", "causal", 4096, threads), base, threads)
        row("1x4096 `causal_mask(4096, 4096)` tensor", key("long", "causal_mask", 4096, threads), base, threads)
        row("1x4096 `attention_bias` (1, 8, 4096, 4096)", key("long", "bias", 4096, threads), base, threads)
        row("1x4096 `alibi_slopes`", key("long", "alibi", 4096, threads), base, threads)
        pbase = key("padded", "unpadded", 1024, threads, 8)
        row("8x1024 unpadded", pbase, None, threads)
        row("8x1024 `key_lengths` 64..1024", key("padded", "key_lengths", 1024, threads, 8), pbase, threads)
        row("8x1024 `key_padding_mask` 64..1024", key("padded", "key_padding_mask", 1024, threads, 8), pbase, threads)
        for n in (4096, 8192, 16384):
            row(f"1x{n} full", key("window", "plain", n, threads), None, threads)
        for n in (4096, 8192, 16384, 32768, 65536):
            row(f"1x{n} window (`causal`, `window_left = 255`)", key("window", "window", n, threads),
                key("window", "plain", n, threads) if n <= 16384 else None, threads)

    targets = []

    def target(label, value, limit, ok):
        targets.append(f"| {label} | {value} | {limit} | {'**PASS**' if ok else '**FAIL**'} |")

    c = t(key("long", "causal", 4096, 1)) / t(key("long", "plain", 4096, 1))
    target("1x4096 causal / plain time, 1 thread", f"{c:.2f}", "<= 0.65", c <= 0.65)
    cm = t(key("long", "causal", 4096, 1)) / t(key("long", "causal_mask", 4096, 1))
    target("1x4096 causal option / causal_mask tensor", f"{cm:.2f}", "<= 1 (no slower)", cm <= 1.0)
    w = t(key("window", "plain", 16384, 1)) / t(key("window", "window", 16384, 1))
    target("1x16384 full / sliding window (w 256) time, 1 thread", f"{w:.1f}x", ">= 8x", w >= 8)
    target("1x16384 sliding window peak RSS", f"{rss['window']:.0f} MiB (full: {rss['plain']:.0f} MiB)", "<= 300 MiB",
           rss["window"] <= 300)
    per_token = [t(key("window", "window", n, 1)) / n for n in (4096, 8192, 16384, 32768, 65536)]
    lin = max(per_token) / min(per_token)
    target("sliding window time per token, 4096 .. 65536 (max / min)", f"{lin:.2f}", "linear (<= 1.5)", lin <= 1.5)
    p = t(key("padded", "key_lengths", 1024, 1, 8)) / t(key("padded", "unpadded", 1024, 1, 8))
    target("8x1024 key_lengths / unpadded time, 1 thread", f"{p:.2f}", "<= 0.8", p <= 0.8)
    for case in ("bias", "alibi"):
        r = t(key("long", case, 4096, 1)) / t(key("long", "plain", 4096, 1))
        target(f"1x4096 {case} / plain time, 1 thread", f"{r:.2f}", "<= 1.3", r <= 1.3)
    lines += ["", "| target | measured (medians) | required | |", "|---|---|---|---|"] + targets
    lines += ["", "![sliding window and full attention time against the sequence length](window.png)", "", END]

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for threads, style in ((1, "-"), (2, "--")):
            ns = [4096, 8192, 16384, 32768, 65536]
            ax.plot(ns, [t(key("window", "window", n, threads)) for n in ns], "o" + style,
                    label=f"sliding window 256, {threads} thread{'s' if threads > 1 else ''}")
            ns = [4096, 8192, 16384]
            ax.plot(ns, [t(key("window", "plain", n, threads)) for n in ns], "s" + style,
                    label=f"full attention, {threads} thread{'s' if threads > 1 else ''}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (batch 1, d_model 512, h 8)")
        ax.set_ylabel("forward time, ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    except ImportError:
        print("matplotlib missing (python3-matplotlib): no plot", file=sys.stderr)

    replace_section(args.out, BEGIN, END, lines[1:-1])
    print("\n".join(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
