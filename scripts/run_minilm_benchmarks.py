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
            form = name.split("/")[1]  # "attention" (padded) or "packed"
            ours.setdefault((form, int(name.split("threads:")[1])), []).extend(ms(b) for b in records)
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
         "all-MiniLM-L6-v2 on 32 sentences of 18 to 128 tokens (2329 in all), float. transformers runs them "
         "padded to (32, 128) with its padding mask; sdpa runs them padded the same way (key_lengths: every "
         "padding row still projected and attending, as in transformers) and packed without padding "
         "(cu_seqlens: each sentence's own rows, the bits of its real rows in the padded call).", "",
         "| threads | sdpa padded | sdpa packed | transformers eager | transformers SDPA | padded vs eager / SDPA "
         "| packed vs eager / SDPA | target (packed) |",
         "|---|---|---|---|---|---|---|---|"]
    for t in sorted({t for _, t in ours}):
        cells, ratios = [], {}
        for form in ("attention", "packed"):
            r = ours.get((form, t), [])
            cells.append(f"{min(r):.1f} / {statistics.median(r):.1f}" if r else "—")
        peer_cells = []
        for impl in ("eager", "sdpa"):
            runs = peers.get((impl, t), [])
            if runs:
                pmd = statistics.median(d for _, d in runs)
                peer_cells.append(f"{min(m for m, _ in runs):.1f} / {pmd:.1f}")
                for form in ("attention", "packed"):
                    r = ours.get((form, t), [])
                    ratios[(form, impl)] = pmd / statistics.median(r) if r else float("nan")
            else:
                peer_cells.append("—")
                for form in ("attention", "packed"):
                    ratios[(form, impl)] = float("nan")
        ok = all(ratios[("packed", impl)] >= 1.3 for impl in ("eager", "sdpa"))
        L.append(f"| {t} | {cells[0]} | {cells[1]} | {peer_cells[0]} | {peer_cells[1]} | "
                 f"{ratios[('attention', 'eager')]:.2f}x / {ratios[('attention', 'sdpa')]:.2f}x | "
                 f"{ratios[('packed', 'eager')]:.2f}x / {ratios[('packed', 'sdpa')]:.2f}x | "
                 f">= 1.3x (medians): {'**PASS**' if ok else '**FAIL**'} |")
    replace_section(args.out, BEGIN, END, L)
    print("\n".join(L))


if __name__ == "__main__":
    main()
