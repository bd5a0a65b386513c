#!/usr/bin/env python3
"""Runs bench/flex_bench (programmable attention against the fixed options and separate calls doing the
same work) and, with --venv, PyTorch's flex_attention from pip (bench/peers/flex_peer.py: eager and
torch.compile) in the same run, and writes bench/results/flex.md: the machine, its CPU flags, the date, the
command, min and median per case and the ratios issue 47 asks for.

    python3 scripts/run_flex_benchmarks.py --build --venv /tmp/venv [--repetitions 3]
"""

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]


def cell(t):
    return "-" if t is None else f"{t[0]:.2f} / {t[1]:.2f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a[0] / b[0]:.2f}x"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true", help="configure and build build-bench first")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--venv", help="a virtual environment with torch (pip): PyTorch's flex_attention in the same run")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "flex.md"))
    args = ap.parse_args()
    command = "python3 scripts/run_flex_benchmarks.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.build:
        benchlib.build_benchmarks(ROOT, args.build_dir, ["flex_bench"])
    exe = os.path.join(args.build_dir, "bench", "flex_bench")
    runs, _ = benchlib.bench(exe, ".", args.repetitions, os.path.join(args.build_dir, "flex_bench.json"))
    ours = {name: (min(t), statistics.median(t)) for name, t in benchlib.times(runs).items()}

    torch, torch_errors, torch_version = {}, {}, None
    if args.venv:
        py = os.path.join(args.venv, "bin", "python")
        out = subprocess.run([py, os.path.join(ROOT, "bench", "peers", "flex_peer.py"), "--n", "4096", "--repetitions",
                              str(args.repetitions)], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            r = json.loads(line)
            torch_version = r.get("torch", torch_version)
            if "min_ms" in r:
                torch[r["name"]] = (r["min_ms"], r["median_ms"])
            elif "error" in r:
                torch_errors[r["name"]] = r["error"]

    model, flags = benchlib.cpu(FLAGS)
    lines = ["# Programmable attention (bench/flex_bench.cpp, bench/peers/flex_peer.py)", "",
             "Written by scripts/run_flex_benchmarks.py; do not edit by hand.", "",
             f"- machine: {model}, {os.cpu_count()} cores; flags: {' '.join(flags)}",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- command: `{command}` ({args.repetitions} repetitions of each case, min / median ms)",
             f"- PyTorch: {torch_version or 'not run (no --venv)'} from pip, torch.set_num_threads as the case says",
             "- float32, sdpa::attention on (1, 8, N, 64) head tensors (d_model 512's heads)", ""]

    def row(label, *cells):
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for t in (1, 2):
        th = f"/threads:{t}"
        lines += [f"## {t} thread(s)", "", "### Causal written three ways, N 8192", "",
                  "| pass | options.causal | flex::causal + plan | lambda + block_mask_from | builtin / fixed | lambda / fixed |",
                  "|---|---|---|---|---:|---:|"]
        for p in ("fwd", "bwd"):
            f, b, l = (ours.get(f"flex/causal/{h}/N:8192/{p}{th}") for h in ("fixed", "builtin", "lambda"))
            row(p, cell(f), cell(b), cell(l), ratio(b, f), ratio(l, f))
        lines += ["", "### 8 documents of 1024 in one sequence of 8192, forward", "",
                  "| document & causal + plan | 8 causal calls of 1024 | causal over 8192 | plan / separate | dense / plan |",
                  "|---|---|---|---:|---:|"]
        d, s, c = (ours.get(f"flex/document/{h}/N:8192/fwd{th}") for h in ("builtin", "separate", "dense_causal"))
        row(cell(d), cell(s), cell(c), ratio(d, s), ratio(c, d))
        lines += ["", "### T5 buckets (32, max distance 128), N 4096, no mask", "",
                  "| pass | flex::t5_buckets | dense (1, 8, N, N) bias | score / dense bias |", "|---|---|---|---:|"]
        for p in ("fwd", "bwd"):
            sc, db = (ours.get(f"flex/t5/{h}/N:4096/{p}{th}") for h in ("score", "dense_bias"))
            row(p, cell(sc), cell(db), ratio(sc, db))
        lines += ["", "### Building a plan from a generic lambda, N 32768", "",
                  "| mask | block_mask_from | one forward with the plan | build / forward |", "|---|---|---|---:|"]
        for m in ("causal", "document"):
            pb, fw = ours.get(f"flex/plan/{m}/N:32768{th}"), ours.get(f"flex/plan_forward/{m}/N:32768{th}")
            row(m, cell(pb), cell(fw), "-" if pb is None or fw is None else f"{100 * pb[0] / fw[0]:.1f}%")
        lines += ["", "### Against PyTorch's flex_attention, N 4096, forward", "",
                  "| case | sdpa | PyTorch eager | PyTorch torch.compile | PyTorch best / sdpa | PyTorch backward on the CPU |",
                  "|---|---|---|---|---:|---|"]
        for case in ("causal", "document", "sliding", "prefix_lm", "t5"):
            ours_t = ours.get(f"flex/peer/{case}/N:4096{th}")
            modes = {m: torch.get(f"flex/{case}/N:4096/mode:{m}{th}") for m in ("eager", "compile")}
            errs = {m: torch_errors.get(f"flex/{case}/N:4096/mode:{m}{th}") for m in ("eager", "compile")}
            peer = [x for x in modes.values() if x is not None]
            best = min(peer) if peer else None
            bwd = []
            for m in ("eager", "compile"):
                name = f"flex_backward/{case}/N:4096/mode:{m}{th}"
                if name in torch:
                    bwd.append(f"{m}: {torch[name][0]:.2f} ms")
                elif name in torch_errors:
                    bwd.append(f"{m}: none ({torch_errors[name][:60]})")
            row(case, cell(ours_t), cell(modes["eager"]) if modes["eager"] else ("failed" if errs["eager"] else "-"),
                cell(modes["compile"]) if modes["compile"] else ("failed: " + errs["compile"][:60] if errs["compile"] else "-"),
                ratio(best, ours_t), "; ".join(bwd) or "-")
        lines += ["", "### A decoding step over a cache of 4096", "",
                  "| tree of 16 drafts, one call | 1 query | tree / single |", "|---|---|---:|"]
        tr, si = ours.get(f"flex/tree/tree/N:4096{th}"), ours.get(f"flex/tree/single/N:4096{th}")
        row(cell(tr), cell(si), ratio(tr, si))
        lines.append("")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
