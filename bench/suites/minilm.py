"""all-MiniLM-L6-v2's six attention blocks (minilm_bench) against transformers' eager and SDPA attention.

Measures the six self-attention blocks of all-MiniLM-L6-v2 on a ragged batch of 32 x 128 tokens: sdpa
(bench/minilm_bench) against transformers' eager and SDPA attention implementations (bench/peers/
minilm_peer.py, in a virtual environment with today's pip torch and transformers) on the same thread counts,
in rounds that alternate the two (each round: one repetition of sdpa's cases, a few of the peers').

    python3 bench/run.py --suite minilm --build --venv /tmp/venv [--rounds 5]
"""

import json
import os
import statistics
import subprocess

from suites import common

ROOT = common.ROOT
TITLE = "all-MiniLM-L6-v2's attention blocks against transformers (bench/minilm_bench.cpp, bench/peers/minilm_peer.py)"


def add_arguments(ap):
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--venv", required=True, help="a virtual environment with torch and transformers")
    ap.add_argument("--rounds", type=int, default=5)


def measure(args):
    build = os.path.abspath(args.build_dir)
    if args.build:
        common.build_benchmarks(ROOT, build, ["minilm_bench"])
    exe = os.path.join(build, "bench", "minilm_bench")
    python = os.path.join(args.venv, "bin", "python")
    ours, peers, versions = {}, {}, {}
    for r in range(args.rounds):
        out = os.path.join(build, f"minilm_round{r}.json")
        common.run([exe, "--benchmark_repetitions=1", "--benchmark_min_time=1", f"--benchmark_out={out}",
                    "--benchmark_out_format=json"], stdout=subprocess.DEVNULL)
        runs, _ = common.load(out)
        for name, records in runs.items():
            form = name.split("/")[1]  # "attention" (padded) or "packed"
            ours.setdefault(f"sdpa/{form}/threads:{int(name.split('threads:')[1])}", []).extend(common.ms(b) for b in records)
        p = common.run([python, os.path.join(ROOT, "bench", "peers", "minilm_peer.py"), "--repetitions", "5"],
                       capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1")).stdout
        for line in p.splitlines():
            if line.startswith("{"):
                j = json.loads(line)
                peers.setdefault(f"transformers/{j['impl']}/threads:{j['threads']}", []).append((j["min_ms"], j["median_ms"]))
                versions = {"torch": j["torch"], "transformers": j["transformers"]}
    cases = {k: common.case(v) for k, v in ours.items()}
    # A peer's case: the minimum of its rounds' minima and the median of their medians.
    cases.update({k: {"min_ms": min(m for m, _ in v), "median_ms": statistics.median(d for _, d in v),
                      "rounds": [list(x) for x in v]} for k, v in peers.items()})
    return {"rounds": args.rounds, "versions": versions, "cases": cases}


def render(data):
    cases, versions = data["cases"], data["versions"]
    L = [f"{data['rounds']} rounds, each one run "
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
    threads = sorted({int(k.split("threads:")[1]) for k in cases if k.startswith("sdpa/")})
    for t in threads:
        cells, ratios = [], {}
        for form in ("attention", "packed"):
            r = cases.get(f"sdpa/{form}/threads:{t}")
            cells.append(f"{r['min_ms']:.1f} / {r['median_ms']:.1f}" if r else "—")
        peer_cells = []
        for impl in ("eager", "sdpa"):
            p = cases.get(f"transformers/{impl}/threads:{t}")
            for form in ("attention", "packed"):
                r = cases.get(f"sdpa/{form}/threads:{t}")
                ratios[(form, impl)] = common.note(
                    data, f"{form}, {t} thread(s): transformers {impl} / sdpa",
                    p["median_ms"] / r["median_ms"] if p and r else float("nan"))
            peer_cells.append(f"{p['min_ms']:.1f} / {p['median_ms']:.1f}" if p else "—")
        ok = all(ratios[("packed", impl)] >= 1.3 for impl in ("eager", "sdpa"))
        L.append(f"| {t} | {cells[0]} | {cells[1]} | {peer_cells[0]} | {peer_cells[1]} | "
                 f"{ratios[('attention', 'eager')]:.2f}x / {ratios[('attention', 'sdpa')]:.2f}x | "
                 f"{ratios[('packed', 'eager')]:.2f}x / {ratios[('packed', 'sdpa')]:.2f}x | "
                 f">= 1.3x (medians): {'**PASS**' if ok else '**FAIL**'} |")
    return L
