"""Decoding with a KVCache and training (decode_bench, training_bench) against LibTorch 1.13; targets.

Runs bench/decode_bench (KVCache steps, the read bound, recomputing, LibTorch's cat-based decoding loop,
generating 4096 tokens and its peak RSS) and bench/training_bench (forward with a state, backward, PyTorch
autograd in LibTorch, the peak RSS at 16384 tokens), and checks their targets on the medians.

    python3 bench/run.py --suite decode_training [--build] [--repetitions 5]
"""

import json
import os

from suites import common

ROOT = common.ROOT
TITLE = "Decoding with a cache and training (bench/decode_bench.cpp, bench/training_bench.cpp)"


def add_arguments(ap):
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--repetitions", type=int, default=5)


def measure(args):
    build = os.path.abspath(args.build_dir)
    if args.build:
        common.build_benchmarks(ROOT, build, ["decode_bench", "training_bench"])
    b = os.path.join(build, "bench")
    d, _ = common.bench(os.path.join(b, "decode_bench"), "decode/(step|recompute|read|torch)/", args.repetitions,
                        os.path.join(build, "decode_bench.json"))
    g, _ = common.bench(os.path.join(b, "decode_bench"), "decode/generate/", 1, os.path.join(build, "decode_generate.json"))
    decode_rss = json.loads(common.run([os.path.join(b, "decode_bench"), "--peak_rss_generate", "4096"],
                                       capture_output=True, text=True).stdout)
    t, _ = common.bench(os.path.join(b, "training_bench"), "train/", args.repetitions,
                        os.path.join(build, "training_bench.json"))
    training_rss = json.loads(common.run([os.path.join(b, "training_bench"), "--peak_rss", "16384"],
                                         capture_output=True, text=True).stdout)
    cases = common.cases_of_runs(d)
    cases.update(common.cases_of_runs(g))
    cases.update(common.cases_of_runs(t))
    return {"repetitions": args.repetitions, "cases": cases, "decode_rss": decode_rss, "training_rss": training_rss,
            "torch_blas": "OpenBLAS" if os.path.exists("/usr/lib/x86_64-linux-gnu/openblas-pthread") else "Debian's default"}


def render(data):
    cases = data["cases"]
    d = t = {name: rec["runs_ms"] for name, rec in cases.items()}
    g = d
    reps = data["repetitions"]
    med = lambda t, n: cases[n]["median_ms"]  # noqa: E731
    mn = lambda t, n: cases[n]["min_ms"]  # noqa: E731

    # ---- decoding
    rss = data["decode_rss"]
    step = lambda n, batch, t: f"decode/step/cache:{n}/batch:{batch}/threads:{t}"  # noqa: E731
    read = lambda n, t=1: next(k for k in d if k.startswith(f"decode/read/cache:{n}/bytes:") and k.endswith(f"/threads:{t}"))  # noqa: E731
    read8 = next(k for k in d if k.startswith("decode/read/cache:2048/batch:8/"))
    lines = ["## Decoding with a cache", "",
             f"bench/decode_bench: d_model 512, h 8, d_k = d_v = 64, float, eval; one token per sequence per step; min / "
             f"median of {reps} runs. 'read bound': a sum over as many bytes as the step reads (its keys "
             f"and values and the four weight matrices) on as many threads as the step, measured in the same run.", "",
             "| cache entries | batch | threads | step (min / median) | read bound | step / read bound | LibTorch cat loop | LibTorch / sdpa |",
             "|---|---|---|---|---|---|---|---|"]
    for n in (128, 1024, 2048, 4095, 16383):
        for th in (1, 2):
            s = step(n, 1, th)
            rb = med(d, read(n, th))
            tn = {128: 128, 1024: 1024, 4095: 4096}.get(n)
            torch = f"decode/torch/cache:{tn}/batch:1/threads:1" if tn else None
            tc = f"{med(d, torch):.2f} ms" if torch in d and th == 1 else ""
            tr = f"{common.note(data, f'{s}: LibTorch / sdpa', med(d, torch) / med(d, s)):.1f}x" if torch in d and th == 1 else ""
            lines.append(f"| {n} | 1 | {th} | {mn(d, s):.3f} / {med(d, s):.3f} ms | {rb:.3f} ms | "
                         f"{common.note(data, f'{s}: step / read bound', med(d, s) / rb):.2f} | {tc} | {tr} |")
    for th in (1, 2):
        s = step(2048, 8, th)
        rb = f"{med(d, read8):.3f} ms" if th == 1 else ""
        rr = f"{common.note(data, f'{s}: step / read bound', med(d, s) / med(d, read8)):.2f}" if th == 1 else ""
        lines.append(f"| 2048 | 8 | {th} | {mn(d, s):.3f} / {med(d, s):.3f} ms | {rb} | {rr} | | |")
    recompute = med(d, "decode/recompute/N:4096/threads:1")
    gen = g["decode/generate/N:4096/threads:1"][0]
    lines += ["", f"Recomputing forward(x, x, x, {{causal}}) over the 4096 tokens instead: {recompute:.0f} ms. "
                  f"Generating 4096 tokens one by one from an empty cache: {gen / 1e3:.2f} s in all "
                  f"({4096 / (gen / 1e3):.0f} tokens/s), peak RSS {rss['vm_hwm_mib']:.0f} MiB, of which the cache "
                  f"holds {rss['cache_mib']:.0f} MiB, the weights {rss['weights_mib']:.0f} MiB and the benchmark's "
                  f"4096 input tokens {rss['tokens_mib']:.0f} MiB (before generating: {rss['before_mib']:.0f} MiB).", ""]
    tg = []

    def target(label, value, shown, limit, ok):
        common.note(data, label, value)
        tg.append(f"| {label} | {shown} | {limit} | {'**PASS**' if ok else '**FAIL**'} |")

    r = recompute / med(d, step(4095, 1, 1))
    target("step at cache 4095 vs recomputing the 4096-token forward", r, f"{r:.0f}x", ">= 50x", r >= 50)
    r = med(d, step(4095, 1, 1)) / med(d, read(4095))
    target("step at cache 4095 / read bound", r, f"{r:.2f}", "<= 2", r <= 2)
    r = med(d, step(16383, 1, 1)) / med(d, step(16383, 1, 2))
    target("step at cache 16383: 1 thread / 2 threads", r, f"{r:.2f}x", ">= 1.6x", r >= 1.6)
    r = med(d, step(2048, 8, 1)) / 8 / med(d, step(2048, 1, 1))
    target("per token, batch 8 / batch 1 at cache 2048, 1 thread", r, f"{r:.2f}", "<= 0.8", r <= 0.8)
    r = common.note(data, "the floor of per token batch 8 / batch 1", med(d, read8) / 8 / med(d, step(2048, 1, 1)))
    tg.append(f"| (the floor of that ratio here: the batch-8 step's read bound per token / the batch-1 step) | {r:.2f} | | |")
    for n in (128, 1024, 4096):
        torch = f"decode/torch/cache:{n}/batch:1/threads:1"
        mine = step(min(n, 4095), 1, 1)
        if torch in d:
            r = med(d, torch) / med(d, mine)
            target(f"LibTorch cat loop / sdpa at cache {n}", r, f"{r:.1f}x", "> 1", r > 1)
    ov = rss["vm_hwm_mib"] - rss["before_mib"]
    lim = 1.5 * (rss["cache_mib"] + rss["weights_mib"])
    target("generating 4096 tokens: peak RSS growth vs 1.5 x (cache + weights)", ov, f"{ov:.0f} MiB", f"<= {lim:.0f} MiB",
           ov <= lim)
    lines += ["| target | measured (medians) | required | |", "|---|---|---|---|"] + tg

    # ---- training
    rss = data["training_rss"]
    lines += ["", "## Training", "",
              f"bench/training_bench: d_model 512, h 8, float, training mode without dropout, q = k = v; min / median of "
              f"{reps} runs. LibTorch: the module in LibTorch 1.13 ops under autograd (forward and backward(grad_output)), "
              f"1 thread, BLAS: {data['torch_blas']}.", "",
              "| config | threads | forward | backward | forward + backward | backward / forward | LibTorch fwd + bwd | LibTorch / sdpa |",
              "|---|---|---|---|---|---|---|---|"]
    for cfg, label in (("demo", "demo 50x49, d_k 512"), ("long/N:4096", "1x4096, d_k 64"), ("causal/N:4096", "1x4096 causal")):
        for th in (1, 2):
            f_, b_, fb = (med(t, f"train/{cfg}/{w}/threads:{th}") for w in ("forward", "backward", "forward_backward"))
            torch = f"train/{cfg}/torch/threads:1"
            tc = f"{med(t, torch):.0f} ms" if torch in t and th == 1 else ""
            tr = f"{common.note(data, f'train/{cfg}: LibTorch / sdpa', med(t, torch) / fb):.1f}x" if torch in t and th == 1 else ""
            lines.append(f"| {label} | {th} | {f_:.0f} ms | {b_:.0f} ms | {fb:.0f} ms | "
                         f"{common.note(data, f'train/{cfg}/threads:{th}: backward / forward', b_ / f_):.2f} | {tc} | {tr} |")
    target_rows = []

    def target2(label, value, shown, limit, ok):
        common.note(data, label, value)
        target_rows.append(f"| {label} | {shown} | {limit} | {'**PASS**' if ok else '**FAIL**'} |")

    r = med(t, "train/long/N:4096/backward/threads:1") / med(t, "train/long/N:4096/forward/threads:1")
    target2("1x4096 backward / forward, 1 thread", r, f"{r:.2f}", "<= 3.5", r <= 3.5)
    for cfg, need in (("long/N:4096", 5.0), ("demo", 1.5)):
        torch = f"train/{cfg}/torch/threads:1"
        if torch in t:
            r = med(t, torch) / med(t, f"train/{cfg}/forward_backward/threads:1")
            target2(f"{cfg}: LibTorch autograd / sdpa, forward + backward", r, f"{r:.1f}x", f">= {need}x", r >= need)
    r = med(t, "train/long/N:4096/backward/threads:1") / med(t, "train/long/N:4096/backward/threads:2")
    target2("1x4096 backward: 1 thread / 2 threads", r, f"{r:.2f}x", ">= 1.6x", r >= 1.6)
    target2("1x16384 forward + backward peak RSS", rss["vm_hwm_mib"], f"{rss['vm_hwm_mib']:.0f} MiB", "<= 600 MiB",
            rss["vm_hwm_mib"] <= 600)
    lines += ["", "| target | measured (medians) | required | |", "|---|---|---|---|"] + target_rows
    return lines
