"""Before and after a change that should not move performance: core_bench and decode_bench at --base and HEAD.

Builds the core and decode benchmarks (bench/core_bench.cpp, bench/decode_bench.cpp) at a base revision (a
git worktree under the build dir) and at the working tree, runs the two builds' cases in turns (base, head,
base, head, ...: the machine's drift falls on both alike); the page gives per case min / median ms of each
side and head / base of the minima. A ratio above 1 is a slowdown.

    python3 bench/run.py --suite refactor --base 1f8ffae --rounds 3
"""
import os
import statistics
import subprocess

from suites import common

ROOT = common.ROOT
TITLE = "Before and after a refactor: the core and decode benchmarks (bench/core_bench.cpp, bench/decode_bench.cpp)"
SUITES = {
    # target: the cases compared (Google Benchmark filters)
    "core_bench": "core/",
    "decode_bench": "decode/step/|decode/storage/",
}


def add_arguments(ap):
    ap.add_argument("--base", required=True, help="the revision before the change")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-refactor"))
    ap.add_argument("--rounds", type=int, default=3, help="turns of (base, head); each runs every case once")


def measure(args):
    base_rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.base], check=True, capture_output=True,
                              text=True).stdout.strip()
    head_rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], check=True,
                           capture_output=True, text=True).stdout.strip() != ""
    os.makedirs(args.build_dir, exist_ok=True)
    tree = os.path.join(args.build_dir, "base-src")
    if os.path.exists(tree):
        common.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree])
    common.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, base_rev], stdout=subprocess.DEVNULL)
    try:
        sides = {"base": (tree, os.path.join(args.build_dir, "base")), "head": (ROOT, os.path.join(args.build_dir, "head"))}
        for source, build in sides.values():
            common.build_benchmarks(source, build, list(SUITES))
        runs = {side: {} for side in sides}
        for r in range(args.rounds):
            for side, (_, build) in sides.items():
                for target, flt in SUITES.items():
                    out = os.path.join(build, f"{target}.{r}.json")
                    got, _ = common.bench(os.path.join(build, "bench", target), flt, 1, out)
                    for name, t in common.times(got).items():
                        runs[side].setdefault(name, []).extend(t)
    finally:
        common.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree])
    cases = {f"{side}:{name}": common.case(t) for side in runs for name, t in runs[side].items()}
    return {"rounds": args.rounds, "base": base_rev, "head": head_rev + (" with uncommitted changes" if dirty else ""),
            "cases": cases}


def render(data):
    base, head = common.group(data["cases"], "base:"), common.group(data["cases"], "head:")
    lines = [f"- {data['rounds']} turns of base then head, each case once per turn, min / median ms",
             f"- base: {data['base']}; head: {data['head']}", "",
             "| case | base | head | head / base (minima) |", "|---|---|---|---:|"]
    ratios = []
    for name in sorted(set(base) & set(head)):
        b, h = base[name], head[name]
        ratio = common.note(data, f"{name}: head / base", h["min_ms"] / b["min_ms"])
        ratios.append(ratio)
        lines.append(f"| {name} | {b['min_ms']:.3f} / {b['median_ms']:.3f} | {h['min_ms']:.3f} / {h['median_ms']:.3f} | "
                     f"{ratio:.2f}x |")
    if ratios:
        gm = common.note(data, "geometric mean of head / base", statistics.geometric_mean(ratios))
        lines += ["", f"- head / base over the {len(ratios)} cases: geometric mean {gm:.3f}x, "
                  f"range {min(ratios):.2f}x .. {max(ratios):.2f}x"]
    return lines
