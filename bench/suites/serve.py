"""Serving many sequences (serve_bench): the ragged paged step, packed prefill, the memory of forks, the merge
of partial attention, cascade steps over shared prefixes and draft-tree steps; targets.

Measures serving many sequences at once (issue 25) in one session: bench/serve_bench's cases (d_model 512,
h 8, d_k 64, float, 1 thread unless a case says threads:2) in rounds, each round one run of every case, min /
median over the rounds; `serve_bench --fork_memory`; issues 25's and 51's targets checked on the medians.

    python3 bench/run.py --suite serve --build [--rounds 5]
"""

import json
import statistics
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
    times, gflops = {}, {}
    for r in range(args.rounds):
        out = os.path.join(build, f"serve_round{r}.json")
        common.run([exe, "--benchmark_repetitions=1", "--benchmark_min_time=0.5", f"--benchmark_out={out}",
                    "--benchmark_out_format=json"], stdout=subprocess.DEVNULL)
        runs, _ = common.load(out)
        for name, records in runs.items():
            key = name.replace("/real_time", "").replace("/threads:1", "")
            if key.startswith("serve/read/"):
                key = "serve/read"
            if key.startswith("serve/cascade/read/"):
                key = "serve/cascade/read"
            if key.startswith("serve/fma_peak/"):
                gflops.setdefault(key, []).extend(b["GFLOPs"] for b in records)
                continue
            times.setdefault(key, []).extend(common.ms(b) for b in records)
    memory = json.loads([line for line in common.run([exe, "--fork_memory"], capture_output=True, text=True).stdout.splitlines()
                         if line.startswith("{")][0])
    cases = {k: common.case(v) for k, v in times.items()}
    for k, v in gflops.items():
        cases[k] = common.case([1.0 / g for g in v], gflops=v)  # (a time per GFLOP, so min / median order)
    return {"rounds": args.rounds, "cases": cases, "fork_memory": memory}


# Useful FLOPs of the cascade step (64 sequences' scores and p v over the 4096-token prefix and their own 65
# entries, four projections of 64 rows) and of the tree step (16 drafts over 4096 entries, four projections
# of 16 rows; the drafts among themselves are negligible).
CASCADE_FLOPS = 4.0 * 64 * 8 * 64 * (4096 + 64 + 1) + 4.0 * 2.0 * 64 * 512 * 512
TREE_FLOPS = 4.0 * 16 * 8 * 64 * 4096 + 4.0 * 2.0 * 16 * 512 * 512


def render(data):
    med = {k: v["median_ms"] for k, v in data["cases"].items()}
    lo = {k: v["min_ms"] for k, v in data["cases"].items()}
    memory = data["fork_memory"]
    L = [f"{data['rounds']} rounds of every bench/serve_bench case (d_model 512, h 8, d_k 64, "
         "float, 1 thread unless the case says 2); min / median in ms over the rounds.", "",
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
        "serve/cascade/step": "64 sequences forked from a 4096-token prefix, 64 own tokens each, one token each: "
                              "the prefix attended once (cascade)",
        "serve/cascade/ragged_step": "the same step with set_cascade(false): the prefix read once per sequence",
        "serve/cascade/step/threads:2": "the cascade step on 2 threads",
        "serve/cascade/ragged_step/threads:2": "the per-sequence step on 2 threads",
        "serve/cascade/read": "a sum over the cascade step's bytes (the prefix once, the own entries, four weight "
                              "matrices): its read bound",
        "serve/tree/step": "step_tree: 16 draft tokens (4 under the last token, 3 under each) on a KVCache of 4096",
        "serve/tree/single_step": "one token's step on the same cache",
        "serve/tree/16_steps": "16 single-token steps",
    }
    for key, text in what.items():
        if key in med:
            L.append(f"| {key} | {lo[key]:.3f} / {med[key]:.3f} | {text} |")
    peaks = {k: v for k, v in data["cases"].items() if k.startswith("serve/fma_peak/")}
    for key, rec in sorted(peaks.items()):
        g = statistics.median(rec["gflops"])
        L.append(f"| {key} | {g:.1f} GFLOP/s (median) | float FMA peak: at it the cascade step's "
                 f"{CASCADE_FLOPS / 1e6:.0f} MFLOP take {CASCADE_FLOPS / g / 1e6:.3f} ms, the tree step's "
                 f"{TREE_FLOPS / 1e6:.0f} MFLOP {TREE_FLOPS / g / 1e6:.3f} ms |")
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
    if "serve/cascade/step" in med:
        checks += [("issue 51: cascade step / per-sequence ragged step (1 thread; >= 4x faster)",
                    r("serve/cascade/step", "serve/cascade/ragged_step"), 0.25),
                   ("issue 51: cascade step / per-sequence ragged step (2 threads)",
                    r("serve/cascade/step/threads:2", "serve/cascade/ragged_step/threads:2"), 0.25),
                   ("issue 51: cascade step / its read bound, prefix counted once (1 thread)",
                    r("serve/cascade/step", "serve/cascade/read"), 1.5)]
    if "serve/tree/step" in med:
        checks += [("issue 51: tree step of 16 drafts / one single-token step", r("serve/tree/step", "serve/tree/single_step"), 1.3),
                   ("issue 51: tree step / 16 single-token steps (>= 8x faster)", r("serve/tree/step", "serve/tree/16_steps"),
                    0.125)]
    L += ["", "| target (issues 25 and 51, medians) | measured | required | |", "|---|---|---|---|"]
    for text, value, bound in checks:
        common.note(data, text, value)
        L.append(f"| {text} | {value:.2f}x | <= {bound}x | **{'PASS' if value <= bound else 'FAIL'}** |")
    return L
