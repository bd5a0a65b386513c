"""Narrow caches and weights (decode_bench, examples/decode): bf16 / f16 / int8 steps, read bounds, accuracy.

Measures the storage types of sdpa/storage.hpp (issue 24) in one session:
  1. bench/decode_bench's decode/storage cases (d_model 512, h 8, d_k 64, 1 thread): a decoding step at 4095
     cached tokens with the cache stored as float32, bfloat16, float16, int8, and bfloat16 weights with a
     bfloat16 cache; batch 8 x 2048 cached tokens; each beside the read bound of its own bytes
     (decode/read/storage: a sum over as many bytes), and on AVX2 machines the step's arithmetic over its
     cached keys and values at the streaming widen + FMA rate (decode/limit/widen_fma, bench/widen_floor.hpp).
     Rounds alternate all cases; min / median over rounds.
  2. decode_bench --storage_error: the relative max-norm error of a 256-token decode with each narrow cache
     against the float cache, on the benchmark's module and on peaked attention, and the cache's bytes.
  3. examples/decode: the greedy generation's tokens that agree with the float cache's, over 256 tokens.
The targets of issue 24 are checked on the medians.

    python3 bench/run.py --suite storage --build [--rounds 5]
"""

import json
import os
import statistics
import subprocess

from suites import common

ROOT = common.ROOT
TITLE = "Storage types: narrow caches and weights (bench/decode_bench.cpp, examples/decode.cpp)"


def add_arguments(ap):
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--examples-dir", default=os.path.join(ROOT, "build-bench-examples"))
    ap.add_argument("--rounds", type=int, default=5)


def measure(args):
    build, examples = os.path.abspath(args.build_dir), os.path.abspath(args.examples_dir)
    if args.build:
        common.build_benchmarks(ROOT, build, ["decode_bench"])
        common.run(["cmake", "-S", ROOT, "-B", examples, "-DCMAKE_BUILD_TYPE=Release", "-DSDPA_BUILD_TESTS=OFF",
                    "-DSDPA_BUILD_EXAMPLES=ON", "-DSDPA_BUILD_BENCHMARKS=OFF"], stdout=subprocess.DEVNULL)
        common.run(["cmake", "--build", examples, "--target", "decode", "-j", "2"], stdout=subprocess.DEVNULL)
    exe = os.path.join(build, "bench", "decode_bench")
    times = {}
    for r in range(args.rounds):
        out = os.path.join(build, f"storage_round{r}.json")
        common.run([exe, "--benchmark_filter=decode/(storage|read/storage|limit/widen_fma)/", "--benchmark_repetitions=1",
                    "--benchmark_min_time=0.5", f"--benchmark_out={out}", "--benchmark_out_format=json"],
                   stdout=subprocess.DEVNULL)
        runs, _ = common.load(out)
        for name, records in runs.items():
            key = name.replace("/real_time", "")
            times.setdefault(key, []).extend(common.ms(b) for b in records)
    errors = [json.loads(line) for line in common.run([exe, "--storage_error"], capture_output=True, text=True).stdout.splitlines()
              if line.startswith("{")]
    agreement = [line for line in common.run([os.path.join(examples, "examples", "decode"), "256"], capture_output=True,
                                             text=True).stdout.splitlines() if line.startswith("k") and " cache: " in line]
    return {"rounds": args.rounds, "cases": {k: common.case(v) for k, v in times.items()}, "errors": errors,
            "agreement": agreement}


def render(data):
    times = {k: v["runs_ms"] for k, v in data["cases"].items()}
    errors, agreement = data["errors"], data["agreement"]
    med = {k: v["median_ms"] for k, v in data["cases"].items()}
    lo = {k: v["min_ms"] for k, v in data["cases"].items()}

    # A ratio of two cases is the median over rounds of their ratio within each round (both cases ran in the
    # same process, seconds apart): this shared machine's clock drifts between rounds by more than the
    # differences measured, and a ratio of the two medians would mix rounds.
    def paired(a, b, scale=1.0):
        if a not in times or b not in times or len(times[a]) != len(times[b]):
            return float("nan")
        return statistics.median(x / (scale * y) for x, y in zip(times[a], times[b]))

    def step(kv, w, n=4095, batch=1):
        return f"decode/storage/kv:{kv}/weights:{w}/cache:{n}/batch:{batch}/threads:1"

    def bound(kv, w, n=4095, batch=1):
        prefix = f"decode/read/storage/kv:{kv}/weights:{w}/cache:{n}/batch:{batch}/bytes:"
        keys = [k for k in med if k.startswith(prefix)]
        return keys[0] if keys else None

    cases = [("f32", "f32", 4095, 1), ("bf16", "f32", 4095, 1), ("f16", "f32", 4095, 1), ("int8", "f32", 4095, 1),
             ("bf16", "bf16", 4095, 1), ("f32", "f32", 2048, 1), ("f32", "f32", 2048, 8), ("bf16", "f32", 2048, 8),
             ("bf16", "bf16", 2048, 8)]
    L = [f"{data['rounds']} rounds, each one run of every case of bench/decode_bench's "
         "decode/storage and decode/read/storage (d_model 512, h 8, d_k 64, float compute, 1 thread); min / median "
         "in ms over the rounds. The read bound is a sum over the step's bytes (its cache, int8's scales, the four "
         "weight matrices) in the same run. Ratios are medians over the rounds of each round's own ratio.", "",
         "| cache | weights | cached tokens | batch | step | read bound | step / bound | vs the float step |",
         "|---|---|---|---|---|---|---|---|"]
    for kv, w, n, b in cases:
        s, rb = step(kv, w, n, b), bound(kv, w, n, b)
        if s not in med:
            continue
        ratio = f"{common.note(data, f'{s}: step / read bound', paired(s, rb)):.2f}x" if rb else "-"
        vs = f"{common.note(data, f'{s}: / the float step', paired(s, step('f32', 'f32', n, b))):.2f}x"
        L.append(f"| {kv} | {w} | {n} | {b} | {lo[s]:.3f} / {med[s]:.3f} | "
                 f"{(f'{lo[rb]:.3f} / {med[rb]:.3f}' if rb else '-')} | {ratio} | {vs} |")
    # The compute side of the 4095-token steps: their attention's arithmetic at the streaming widen + FMA rate
    # (entries in L1), plus the weights' share of the read bound (their bytes over the step's): what a step
    # takes if every loop ran at the machine's streaming rate and nothing else cost anything.
    limits = [(kv, w) for kv, w, n, b in cases if n == 4095 and f"decode/limit/widen_fma/kv:{kv}/cache:4095/threads:1" in med]
    if limits:
        L += ["", "The arithmetic side (AVX2 machines): each 4095-token step's attention over its cached keys and values "
              "(2 x 4095 x 512 entries) at the streaming rate of the loop its kernels run (load, widen, one FMA into "
              "one of 8 accumulators; entries in L1: `decode/limit/widen_fma`, bench/widen_floor.hpp), plus the "
              "weights' share of the read bound (their bytes over the step's). Medians in ms; ratios over the read "
              "bound as above.", "",
              "| cache | weights | attention at the widen + FMA rate | + the weights' read | / read bound | the step / that floor |",
              "|---|---|---|---|---|---|"]
        for kv, w in limits:
            lim, s, rb = f"decode/limit/widen_fma/kv:{kv}/cache:4095/threads:1", step(kv, w), bound(kv, w)
            if not rb or s not in med:
                continue
            total = float(rb.split("bytes:")[1].split("/")[0])
            weight_bytes = 4.0 * 512 * 512 * (2 if w == "bf16" else 4)
            floor = [a + r * weight_bytes / total for a, r in zip(times[lim], times[rb])]
            L.append(f"| {kv} | {w} | {med[lim]:.3f} | {statistics.median(floor):.3f} | "
                     f"{statistics.median(f / r for f, r in zip(floor, times[rb])):.2f}x | "
                     f"{common.note(data, f'{s}: / the widen + FMA floor', statistics.median(x / f for x, f in zip(times[s], floor))):.2f}x |")
    L += ["", "Accuracy (`decode_bench --storage_error`: 64-token prompt, then 256 steps; relative max-norm error of the "
          "outputs against the float cache; the queries' weights scaled by 8 and 32 make the attention peaked) and bytes:",
          "", "| cache | queries x1 | x8 | x32 | bytes / float cache's |", "|---|---|---|---|---|"]
    for s_name in ("kBFloat16", "kFloat16", "kInt8"):
        rows = {e["q_scale"]: e for e in errors if e["storage"] == s_name}
        if not rows:
            continue
        any_row = next(iter(rows.values()))
        cells = " | ".join(f"{rows[q]['error']:.2g}" if q in rows else "-" for q in (1, 8, 32))
        L.append(f"| {s_name} | {cells} | {any_row['bytes'] / any_row['float_bytes']:.4f} |")
    L += ["", "Greedy generation (`examples/decode 256`): " + "; ".join(agreement) + "."]

    f32, bf16, i8, bf16w = step("f32", "f32"), step("bf16", "f32"), step("int8", "f32"), step("bf16", "bf16")
    checks = [("bf16 cache step / float cache step (4095 cached)", paired(bf16, f32), "<=", 0.6),
              ("int8 cache step / float cache step", paired(i8, f32), "<=", 0.45),
              ("bf16 weights + bf16 cache step / float step", paired(bf16w, f32), "<=", 0.55),
              ("batch 8 x 2048, bf16 cache: time per token / float batch-1 step at 2048",
               paired(step("bf16", "f32", 2048, 8), step("f32", "f32", 2048, 1), 8.0), "<=", 0.8)]
    for kv, w, n, b in cases:
        s, rb = step(kv, w, n, b), bound(kv, w, n, b)
        if s in med and rb:
            checks.append((f"{kv} cache, {w} weights, {n} x {b}: step / read bound", paired(s, rb), "<=", 1.6))
    for e in errors:
        limit = {"kBFloat16": 1e-2, "kFloat16": 2e-3, "kInt8": 3e-2}[e["storage"]]
        checks.append((f"{e['storage']} cache, queries x{e['q_scale']:g}: relative error", e["error"], "<=", limit))
    for e in errors:
        if e["q_scale"] == 1:
            want = 0.5 if e["storage"] != "kInt8" else 0.27
            op = "==" if e["storage"] != "kInt8" else "<="
            checks.append((f"{e['storage']} cache bytes / float cache's", e["bytes"] / e["float_bytes"], op, want))
    L += ["", "| target (issue 24, medians of per-round ratios) | measured | required | |", "|---|---|---|---|"]
    for text, value, op, limit in checks:
        common.note(data, text, value)
        ok = value <= limit if op == "<=" else abs(value - limit) < 1e-12
        fmt = f"{value:.3g}" if value < 0.1 else f"{value:.2f}"
        L.append(f"| {text} | {fmt} | {op} {limit} | **{'PASS' if ok else 'FAIL'}** |")
    return L
