"""Attention variants (variants_bench): causal, causal mask, windows to 65536, key lengths, bias, ALiBi; targets.

Runs bench/variants_bench (the AttentionOptions variants against plain attention, 1 and 2 threads) and the
peak memory of a sliding-window forward, checks the attention-variant targets, and draws bench/window.png
(time against sequence length, sliding window and full attention; --plot).

    python3 bench/run.py --suite variants [--build] [--repetitions 5]

Needs Google Benchmark (libbenchmark-dev) and matplotlib (python3-matplotlib) for the plot.
"""

import json
import os
import re
import subprocess
import sys

from suites import common

ROOT = common.ROOT
TITLE = "Attention variants (AttentionOptions, bench/variants_bench.cpp)"


def add_arguments(ap):
    ap.add_argument("--build", action="store_true", help="configure and build variants_bench first")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--filter", default="variants/")
    ap.add_argument("--plot", default=os.path.join(ROOT, "bench", "window.png"))


def measure(args):
    build = os.path.abspath(args.build_dir)
    if args.build:
        common.build_benchmarks(ROOT, build, ["variants_bench"])
    exe = os.path.join(build, "bench", "variants_bench")
    out_json = os.path.join(build, "variants_bench.json")
    bench_cmd = [exe, f"--benchmark_filter={args.filter}", f"--benchmark_repetitions={args.repetitions}",
                 "--benchmark_min_time=0.5", f"--benchmark_out={out_json}", "--benchmark_out_format=json"]
    common.run(bench_cmd, stdout=subprocess.DEVNULL)
    rss = {}
    for case in ("window", "plain"):
        out = common.run([exe, "--peak_rss", case, "16384"], capture_output=True, text=True).stdout
        rss[case] = json.loads(out)["vm_hwm_mib"]
    runs, _ = common.load(out_json)
    cases = common.cases_of_runs(runs)
    # The GFLOP counter of each case, as the binary registered it.
    with open(out_json) as f:
        for b in json.load(f)["benchmarks"]:
            name = re.sub(r"/process_time/real_time$", "", b.get("run_name", b["name"]))
            if b.get("run_type") != "aggregate" and name in cases:
                cases[name]["gflop"] = b.get("GFLOP", 0)
    return {"repetitions": args.repetitions,
            "binary_command": " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in bench_cmd[:4]),
            "peak_rss_mib": rss, "cases": cases}


def key(group, case, n, threads, batch=None):
    return f"variants/{group}/{case}/N:{n}" + (f"/batch:{batch}" if batch else "") + f"/threads:{threads}"


def render(data):
    cases, rss = data["cases"], data["peak_rss_mib"]

    def t(name, stat="median_ms"):
        return cases[name][stat]

    lines = [f"Runs `{data['binary_command']}`. d_model 512, h 8, d_k = d_v = 64, float, eval. Times: min / median of "
             f"{data['repetitions']} runs.", "",
             "| case | threads | time (min / median) | vs plain | GFLOP/s (median) |", "|---|---|---|---|---|"]

    def row(label, name, base, threads):
        if name not in cases:
            return
        ms_min, ms_med = t(name, "min_ms"), t(name)
        ratio = common.note(data, f"{name} / plain", ms_med / t(base)) if base and base in cases else None
        rate = cases[name].get("gflop", 0) / (ms_med / 1e3)
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

    def target(label, value, shown, limit, ok):
        common.note(data, label, value)
        targets.append(f"| {label} | {shown} | {limit} | {'**PASS**' if ok else '**FAIL**'} |")

    def ratio(a, b):
        return t(a) / t(b) if a in cases and b in cases else float("nan")

    c = ratio(key("long", "causal", 4096, 1), key("long", "plain", 4096, 1))
    target("1x4096 causal / plain time, 1 thread", c, f"{c:.2f}", "<= 0.65", c <= 0.65)
    cm = ratio(key("long", "causal", 4096, 1), key("long", "causal_mask", 4096, 1))
    target("1x4096 causal option / causal_mask tensor", cm, f"{cm:.2f}", "<= 1 (no slower)", cm <= 1.0)
    w = ratio(key("window", "plain", 16384, 1), key("window", "window", 16384, 1))
    target("1x16384 full / sliding window (w 256) time, 1 thread", w, f"{w:.1f}x", ">= 8x", w >= 8)
    target("1x16384 sliding window peak RSS", rss["window"], f"{rss['window']:.0f} MiB (full: {rss['plain']:.0f} MiB)",
           "<= 300 MiB", rss["window"] <= 300)
    windows = [key("window", "window", n, 1) for n in (4096, 8192, 16384, 32768, 65536)]
    if all(w in cases for w in windows):
        per_token = [t(w) / n for w, n in zip(windows, (4096, 8192, 16384, 32768, 65536))]
        lin = max(per_token) / min(per_token)
    else:
        lin = float("nan")
    target("sliding window time per token, 4096 .. 65536 (max / min)", lin, f"{lin:.2f}", "linear (<= 1.5)", lin <= 1.5)
    p = ratio(key("padded", "key_lengths", 1024, 1, 8), key("padded", "unpadded", 1024, 1, 8))
    target("8x1024 key_lengths / unpadded time, 1 thread", p, f"{p:.2f}", "<= 0.8", p <= 0.8)
    for case in ("bias", "alibi"):
        r = ratio(key("long", case, 4096, 1), key("long", "plain", 4096, 1))
        target(f"1x4096 {case} / plain time, 1 thread", r, f"{r:.2f}", "<= 1.3", r <= 1.3)
    lines += ["", "| target | measured (medians) | required | |", "|---|---|---|---|"] + targets
    if data.get("plot"):
        lines += ["", f"![sliding window and full attention time against the sequence length]({data['plot']})"]
    return lines


def after(args, data):
    """Draws --plot from the JSON's cases and links it from the page."""
    cases = data["cases"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (python3-matplotlib): no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for threads, style in ((1, "-"), (2, "--")):
        ns = [n for n in (4096, 8192, 16384, 32768, 65536) if key("window", "window", n, threads) in cases]
        ax.plot(ns, [cases[key("window", "window", n, threads)]["median_ms"] for n in ns], "o" + style,
                label=f"sliding window 256, {threads} thread{'s' if threads > 1 else ''}")
        ns = [n for n in (4096, 8192, 16384) if key("window", "plain", n, threads) in cases]
        ax.plot(ns, [cases[key("window", "plain", n, threads)]["median_ms"] for n in ns], "s" + style,
                label=f"full attention, {threads} thread{'s' if threads > 1 else ''}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (batch 1, d_model 512, h 8)")
    ax.set_ylabel("forward time, ms (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    plt.close(fig)
    data["plot"] = os.path.relpath(os.path.abspath(args.plot), os.path.dirname(os.path.abspath(args.out)))
