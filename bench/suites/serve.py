"""Serving many sequences (serve_bench): the ragged paged step, packed prefill, the memory of forks; targets.

Measures serving many sequences at once (issue 25) in one session: bench/serve_bench's cases (d_model 512,
h 8, d_k 64, float, 1 thread) in rounds, each round one run of every case, min / median over the rounds;
`serve_bench --fork_memory`; issue 25's targets checked on the medians.

    python3 bench/run.py --suite serve --build [--rounds 5]
"""

import json
import os
import subprocess

from suites import common

ROOT = common.ROOT
TITLE = "Serving many sequences (bench/serve_bench.cpp)"


def add_arguments(ap):
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--rounds", type=int, default=5)


def measure(args):
    build = os.path.abspath(args.build_dir)
    if args.build:
        common.build_benchmarks(ROOT, build, ["serve_bench"])
    exe = os.path.join(build, "bench", "serve_bench")
    times = {}
    for r in range(args.rounds):
        out = os.path.join(build, f"serve_round{r}.json")
        common.run([exe, "--benchmark_repetitions=1", "--benchmark_min_time=0.5", f"--benchmark_out={out}",
                    "--benchmark_out_format=json"], stdout=subprocess.DEVNULL)
        runs, _ = common.load(out)
        for name, records in runs.items():
            key = name.replace("/real_time", "").replace("/threads:1", "")
            if key.startswith("serve/read/"):
                key = "serve/read"
            times.setdefault(key, []).extend(common.ms(b) for b in records)
    memory = json.loads([line for line in common.run([exe, "--fork_memory"], capture_output=True, text=True).stdout.splitlines()
                         if line.startswith("{")][0])
    return {"rounds": args.rounds, "cases": {k: common.case(v) for k, v in times.items()}, "fork_memory": memory}


def render(data):
    med = {k: v["median_ms"] for k, v in data["cases"].items()}
    lo = {k: v["min_ms"] for k, v in data["cases"].items()}
    memory = data["fork_memory"]
    L = [f"{data['rounds']} rounds of every bench/serve_bench case (d_model 512, h 8, d_k 64, "
         "float, 1 thread); min / median in ms over the rounds.", "",
         "| case | time | what it is |", "|---|---|---|"]
    what = {
        "serve/ragged_step": "one PagedKVCache step of 8 sequences of 100..4000 cached tokens (blocks of 64), one token each",
        "serve/separate_steps": "the same 8 sequences as 8 KVCaches, one step each",
        "serve/read": "a sum over the ragged step's bytes (keys, values, four weight matrices): its read bound",
        "serve/packed_prefill": "8 prompts of 64..1024 tokens packed in one causal forward (cu_seqlens)",
        "serve/separate_prefill": "the 8 prompts as 8 causal forwards",
        "serve/padded_prefill": "the 8 prompts padded to 1024 in one batch, key_lengths hiding the padding",
        "serve/merge/one_call": "sdpa::attention, 1 x 4096 queries over 4096 keys (h 8, d 64)",
        "serve/merge/two_halves": "the same as two calls over 2048 keys each with their log-sum-exp, merged",
    }
    for key, text in what.items():
        if key in med:
            L.append(f"| {key} | {lo[key]:.3f} / {med[key]:.3f} | {text} |")
    L += ["", f"Forks (`serve_bench --fork_memory`): 16 forks of a 2000-token prompt, each decoding 100 tokens, in blocks "
          f"of {memory['block_size']}: {memory['blocks_used']} blocks, {memory['bytes']} bytes, {memory['ratio']:.3f}x the "
          f"bytes of one prompt and the 16 continuations (16 copies of the prompt: {memory['copies_ratio']:.2f}x)."]

    def r(a, b):
        return med[a] / med[b] if a in med and b in med else float("nan")

    checks = [("ragged step / sum of the 8 separate steps", r("serve/ragged_step", "serve/separate_steps"), 1.15),
              ("ragged step / its read bound", r("serve/ragged_step", "serve/read"), 1.6),
              ("packed prefill / sum of the separate forwards", r("serve/packed_prefill", "serve/separate_prefill"), 1.05),
              ("packed prefill / padded batch with key_lengths", r("serve/packed_prefill", "serve/padded_prefill"), 0.7),
              ("16 forks: cache bytes / one prompt + 16 continuations", memory["ratio"], 1.1)]
    if "serve/merge/two_halves" in med:
        checks.append(("issue 51: two halves merged / one call over all keys",
                       r("serve/merge/two_halves", "serve/merge/one_call"), 1.1))
    L += ["", "| target (issue 25, medians) | measured | required | |", "|---|---|---|---|"]
    for text, value, bound in checks:
        common.note(data, text, value)
        L.append(f"| {text} | {value:.2f}x | <= {bound}x | **{'PASS' if value <= bound else 'FAIL'}** |")
    return L
