#!/usr/bin/env python3
"""Before and after a change that should not move performance (a refactor): builds the core and decode
benchmarks (bench/core_bench.cpp, bench/decode_bench.cpp) at a base revision (a git worktree under the build
dir) and at the working tree, runs the two builds' cases in turns (base, head, base, head, ...: the machine's
drift falls on both alike) and writes bench/results/refactor.md: per case min / median ms of each side and
head / base of the minima. A ratio above 1 is a slowdown.

    python3 scripts/run_refactor_benchmarks.py --base 1f8ffae --rounds 3
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = benchlib.ROOT
SUITES = {
    # target: the cases compared (Google Benchmark filters)
    "core_bench": "core/",
    "decode_bench": "decode/step/|decode/storage/",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the revision before the change")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-refactor"))
    ap.add_argument("--rounds", type=int, default=3, help="turns of (base, head); each runs every case once")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "refactor.md"))
    args = ap.parse_args()
    command = "python3 scripts/run_refactor_benchmarks.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    base_rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.base], check=True, capture_output=True,
                              text=True).stdout.strip()
    head_rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], check=True,
                           capture_output=True, text=True).stdout.strip() != ""
    os.makedirs(args.build_dir, exist_ok=True)
    tree = os.path.join(args.build_dir, "base-src")
    if os.path.exists(tree):
        benchlib.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree])
    benchlib.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, base_rev], stdout=subprocess.DEVNULL)
    try:
        sides = {"base": (tree, os.path.join(args.build_dir, "base")), "head": (ROOT, os.path.join(args.build_dir, "head"))}
        for source, build in sides.values():
            benchlib.build_benchmarks(source, build, list(SUITES))
        runs = {side: {} for side in sides}
        for r in range(args.rounds):
            for side, (_, build) in sides.items():
                for target, flt in SUITES.items():
                    out = os.path.join(build, f"{target}.{r}.json")
                    got, _ = benchlib.bench(os.path.join(build, "bench", target), flt, 1, out)
                    for name, t in benchlib.times(got).items():
                        runs[side].setdefault(name, []).extend(t)
    finally:
        benchlib.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree])

    model, present = benchlib.cpu(["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile"])
    lines = ["# Before and after a refactor: the core and decode benchmarks (bench/core_bench.cpp, bench/decode_bench.cpp)",
             "", "Written by scripts/run_refactor_benchmarks.py; do not edit by hand.", "",
             f"- machine: {model}, {os.cpu_count()} cores; flags: {' '.join(present)}",
             f"- date: {benchlib.datetime.datetime.now(benchlib.datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- command: `{command}` ({args.rounds} turns of base then head, each case once per turn, min / median ms)",
             f"- base: {base_rev}; head: {head_rev}{' with uncommitted changes' if dirty else ''}", "",
             "| case | base | head | head / base (minima) |", "|---|---|---|---:|"]
    ratios = []
    for name in sorted(set(runs["base"]) & set(runs["head"])):
        b, h = runs["base"][name], runs["head"][name]
        ratio = min(h) / min(b)
        ratios.append(ratio)
        lines.append(f"| {name} | {min(b):.3f} / {statistics.median(b):.3f} | {min(h):.3f} / {statistics.median(h):.3f} | "
                     f"{ratio:.2f}x |")
    if ratios:
        lines += ["", f"- head / base over the {len(ratios)} cases: geometric mean "
                  f"{statistics.geometric_mean(ratios):.3f}x, range {min(ratios):.2f}x .. {max(ratios):.2f}x"]
    benchlib.write_results(args.out, lines)


if __name__ == "__main__":
    main()
