#!/usr/bin/env python3
"""Measures the six self-attention blocks of all-MiniLM-L6-v2 on a ragged batch of 32 x 128 tokens: sdpa
(bench/minilm_bench) against transformers' eager and SDPA attention implementations (bench/peers/
minilm_peer.py, in a virtual environment with today's pip torch and transformers) on the same thread counts,
in rounds that alternate the two (each round: one repetition of sdpa's cases, a few of the peers'), and
writes the "MiniLM" section of bench/RESULTS.md (between its markers; the rest of the file is kept).

    python3 scripts/run_minilm_benchmarks.py --build --venv /tmp/venv [--rounds 5]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import build_benchmarks, load, ms, replace_section, run  # noqa: E402

BEGIN, END = "<!-- minilm:begin -->", "<!-- minilm:end -->"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--venv", required=True, help="a virtual environment with torch and transformers")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "RESULTS.md"))
    args = ap.parse_args()
    build = os.path.abspath(args.build_dir)
    if args.build:
        build_benchmarks(ROOT, build, ["minilm_bench"])
    exe = os.path.join(build, "bench", "minilm_bench")
    python = os.path.join(args.venv, "bin", "python")
    ours, peers, versions, context = {}, {}, {}, {}
    for r in range(args.rounds):
        out = os.path.join(build, f"minilm_round{r}.json")
        run([exe, "--benchmark_repetitions=1", "--benchmark_min_time=1", f"--benchmark_out={out}",
             "--benchmark_out_format=json"], stdout=subprocess.DEVNULL)
        runs, context = load(out)
        for name, records in runs.items():
            ours.setdefault(int(name.split("threads:")[1]), []).extend(ms(b) for b in records)
        p = run([python, os.path.join(ROOT, "bench", "peers", "minilm_peer.py"), "--repetitions", "5"],
                capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1")).stdout
        for line in p.splitlines():
            if line.startswith("{"):
                j = json.loads(line)
                peers.setdefault((j["impl"], j["threads"]), []).append((j["min_ms"], j["median_ms"]))
                versions = {"torch": j["torch"], "transformers": j["transformers"]}

    L = [f"Command: `python3 scripts/run_minilm_benchmarks.py --build --venv /tmp/venv` on "
         f"{context.get('host_name', 'this machine')}, {context.get('date', '')}: {args.rounds} rounds, each one run "
         "of sdpa's cases (bench/minilm_bench) then 5 of each peer's (bench/peers/minilm_peer.py, torch "
         f"{versions.get('torch', '?')}, transformers {versions.get('transformers', '?')} from pip); min / median "
         "in ms over all rounds. The six attention blocks (BertSelfAttention + BertSelfOutput.dense) of "
         "all-MiniLM-L6-v2 on 32 sentences padded to 128 tokens (16 to 128 real ones each), float.", "",
         "| threads | sdpa | transformers eager | transformers SDPA | vs eager | vs SDPA | target |",
         "|---|---|---|---|---|---|---|"]
    for t in sorted(ours):
        mn, md = min(ours[t]), statistics.median(ours[t])
        cells, ratios = [], []
        for impl in ("eager", "sdpa"):
            runs = peers.get((impl, t), [])
            if runs:
                pmn, pmd = min(m for m, _ in runs), statistics.median(d for _, d in runs)
                cells.append(f"{pmn:.1f} / {pmd:.1f}")
                ratios.append(pmd / md)
            else:
                cells.append("—")
                ratios.append(float("nan"))
        ok = all(r >= 1.3 for r in ratios)
        L.append(f"| {t} | {mn:.1f} / {md:.1f} | {cells[0]} | {cells[1]} | {ratios[0]:.2f}x | {ratios[1]:.2f}x | "
                 f">= 1.3x (medians): {'**PASS**' if ok else '**FAIL**'} |")
    replace_section(args.out, BEGIN, END, L)
    print("\n".join(L))


if __name__ == "__main__":
    main()
