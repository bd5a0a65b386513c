"""Each instruction-set path of one binary (SDPA_ISA) and the build without -march, against the peers.

Measures, in one session, what the run-time instruction-set choice costs and wins:
  1. Each path of the same -march=native build (SDPA_ISA=avx512, avx2): bench/table_bench on the peers'
     configurations (1 and 2 threads), core_bench (the attention core alone at 1 x 4096) and gemm_bench (the
     fused QKV and fc_o projections), each beside fma_peak of that path; the peers on the same machine,
     both their Debian 13 builds (PyTorch 2.6, ONNX Runtime 1.21: ../shared/peers/run.sh) and today's pip
     builds (--venv: PyTorch, ONNX Runtime), the latter also with their own ISA capped at AVX2
     (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2; ONNX Runtime's MLAS has no such switch).
  2. A build without -march (SDPA_BENCH_NATIVE=OFF: -O2, as distributions build) against the native one: the
     demo, 1 x 4096 and the decoding step at 4095 cached tokens.
(Today's decoder options against ONNX Runtime's GroupQueryAttention: the decoder suite.)

    /usr/bin/python3 bench/run.py --suite isa --build [--venv /tmp/venv] [--repetitions 5]
        [--peers-from build-bench/peers_peers.json]

Needs root for the Debian 13 chroot; --venv names a virtual environment with torch and onnxruntime.
"""

import json
import os
import re
import statistics
import subprocess

from suites import common

ROOT = common.ROOT
TITLE = "Instruction sets: each path of one binary, and the build without -march"
PEERS = os.path.join(os.path.dirname(ROOT), "shared", "peers")
CONFIGS = [("demo", "demo 50x49, d_k 512"), ("std", "50x49, d_k 64"), ("long", "1x4096, d_k 64"),
           ("long_causal", "1x4096 causal")]
PEER_IMPLS = ["seed", "sdpa2", "mha", "ort", "ort_mha", "ort_dnnl"]
CAPPED_IMPLS = ["seed", "sdpa2", "mha"]
PATHS = ["avx512", "avx2"]
RESUME = [False]


def bench(exe, flt, reps, out, env=None):
    if RESUME[0] and os.path.exists(out) and os.path.getsize(out) > 0:  # --resume: this session's earlier run
        runs, _ = common.load(out)
        if runs:
            return runs
    e = dict(os.environ)
    e.update(env or {})
    common.run([exe, f"--benchmark_filter={flt}", f"--benchmark_repetitions={reps}", "--benchmark_min_time=0.5",
                f"--benchmark_out={out}", "--benchmark_out_format=json", "--benchmark_enable_random_interleaving=true"],
               stdout=subprocess.DEVNULL, env=e)
    runs, _ = common.load(out)
    return runs


def peer(python_cmd, config, impl, threads, env=None):
    e = dict(os.environ)
    e.update(env or {})
    e["OMP_NUM_THREADS"] = str(threads)
    try:
        out = subprocess.run(python_cmd + [config, impl, str(threads)], capture_output=True, text=True, env=e,
                             timeout=1800).stdout
    except subprocess.TimeoutExpired:
        return None
    for line in out.splitlines():
        if "min_ms=" in line:
            return float(line.split("min_ms=")[1].split()[0])
    return None


def add_arguments(ap):
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--venv", default="")
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--work", default="/tmp/sdpa-isa-bench")
    ap.add_argument("--peers-from", default="",
                    help="peers_peers.json of a peers suite run of the same session: its Debian and pip "
                         "peers are used instead of running them again (the AVX2-capped ones still run here)")
    ap.add_argument("--resume", action="store_true", help="keep the results files of an interrupted run of --work")


def measure(args):
    RESUME[0] = args.resume
    native, generic = os.path.join(ROOT, "build-bench"), os.path.join(ROOT, "build-bench-generic")
    os.makedirs(args.work, exist_ok=True)
    targets = ["table_bench", "core_bench", "gemm_bench", "decode_bench"]
    if args.build:
        for d, flag in ((native, "ON"), (generic, "OFF")):
            common.build_benchmarks(ROOT, d, targets, [f"-DSDPA_BENCH_NATIVE={flag}"])
    reps = args.repetitions
    w = lambda n: os.path.join(args.work, n)  # noqa: E731
    cases = {}
    for isa in PATHS:
        env = {"SDPA_ISA": isa}
        cases.update(common.cases_of_runs(bench(os.path.join(native, "bench", "table_bench"),
                                                "fma_peak|table/(demo|std|long|long_causal)/", reps,
                                                w(f"table_{isa}.json"), env), f"{isa}:table:"))
        cases.update(common.cases_of_runs(bench(os.path.join(native, "bench", "core_bench"),
                                                "fma_peak|core/B:1/N:4096/threads:1", reps, w(f"core_{isa}.json"), env),
                                          f"{isa}:core:"))
        cases.update(common.cases_of_runs(bench(os.path.join(native, "bench", "gemm_bench"),
                                                f"fma_peak|^(qkv|fc_o)/.*/sdpa_{isa}/threads:1", reps,
                                                w(f"gemm_{isa}.json"), env), f"{isa}:gemm:"))
    # Native vs -O2 without -march.
    for name, d in (("native", native), ("generic", generic)):
        cases.update(common.cases_of_runs(bench(os.path.join(d, "bench", "table_bench"), "table/(demo|long)/threads:1/",
                                                reps, w(f"build_{name}.json")), f"build-{name}:table:"))
        cases.update(common.cases_of_runs(bench(os.path.join(d, "bench", "decode_bench"),
                                                "decode/step/cache:4095/batch:1/threads:1/", reps,
                                                w(f"build_{name}_decode.json")), f"build-{name}:decode:"))
    # Peers.
    chroot = ["bash", os.path.join(PEERS, "run.sh")]
    peer_rows = {}
    saved = {}
    if args.peers_from:
        with open(args.peers_from) as f:
            saved = json.load(f)["results"]
    for cfg, _ in CONFIGS:
        for threads in (1, 2):
            for impl in PEER_IMPLS:
                py = [os.path.join(args.venv, "bin", "python"), os.path.join(PEERS, "peer_perf.py")] if args.venv else None
                if saved:
                    for kind, key in (("debian", f"{cfg}|{impl}|{threads}"), ("pip", f"{cfg}|pip_{impl}|{threads}")):
                        if key in saved:
                            peer_rows[f"{kind}|{cfg}|{impl}|{threads}"] = saved[key][0]
                else:
                    peer_rows[f"debian|{cfg}|{impl}|{threads}"] = peer(chroot, cfg, impl, threads)
                    if py:
                        peer_rows[f"pip|{cfg}|{impl}|{threads}"] = peer(py, cfg, impl, threads)
                # Only PyTorch's kernels can be capped (ATen's dispatch, oneDNN); ONNX Runtime's MLAS cannot.
                if py and impl in CAPPED_IMPLS:
                    peer_rows[f"pip-avx2|{cfg}|{impl}|{threads}"] = peer(
                        py, cfg, impl, threads, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    return {"repetitions": reps, "cases": cases, "peers_min_ms": peer_rows}


def stats(rec):
    return rec["min_ms"], rec["median_ms"]


def rate(rec):
    c = rec.get("counters", {})
    return statistics.median(c["GFLOPs"]) if "GFLOPs" in c else statistics.median(c.get("FLOPS", [0.0])) / 1e9


def find(runs, pattern):
    """The record of the first case whose name matches the regular expression (from its start)."""
    for name, rec in sorted(runs.items()):
        if re.match(pattern, name):
            return rec
    return None


def render(data):
    cases, peer_rows = data["cases"], data["peers_min_ms"]
    sdpa = {isa: common.group(cases, f"{isa}:table:") for isa in PATHS}
    core = {isa: common.group(cases, f"{isa}:core:") for isa in PATHS}
    gemm = {isa: common.group(cases, f"{isa}:gemm:") for isa in PATHS}
    builds = {name: (common.group(cases, f"build-{name}:table:"), common.group(cases, f"build-{name}:decode:"))
              for name in ("native", "generic")}
    L = [f"Repetitions {data['repetitions']}, interleaved; min / median in ms.", ""]
    L += ["### Each path of one binary against the peers", "",
          "| config | threads | sdpa avx512 | sdpa avx2 | best peer (Debian: PyTorch 2.6, ORT 1.21) | best peer (pip) | "
          "best pip PyTorch capped at AVX2 | avx2 vs best Debian peer | avx2 vs AVX2-capped pip PyTorch |",
          "|---|---|---|---|---|---|---|---|---|"]
    for cfg, label in CONFIGS:
        for threads in (1, 2):
            cells = [find(sdpa[isa], f"table/{cfg}/threads:{threads}$") for isa in PATHS]

            def best(kind):
                vals = [(peer_rows.get(f"{kind}|{cfg}|{i}|{threads}"), i) for i in PEER_IMPLS]
                vals = [(v, i) for v, i in vals if v]
                return min(vals) if vals else (None, "-")
            bd, bp, ba = best("debian"), best("pip"), best("pip-avx2")
            a2 = stats(cells[1])[0] if cells[1] else None
            fmt = lambda r: f"{stats(r)[0]:.1f} / {stats(r)[1]:.1f}" if r else "-"  # noqa: E731
            pv = lambda b: f"{b[0]:.1f} ({b[1]})" if b[0] else "-"  # noqa: E731

            def ratio(b, what):
                if not (b[0] and a2):
                    return "-"
                return f"{common.note(data, f'{label}, {threads} thread(s): {what} / sdpa avx2', b[0] / a2):.2f}x"
            L.append(f"| {label} | {threads} | {fmt(cells[0])} | {fmt(cells[1])} | {pv(bd)} | {pv(bp)} | {pv(ba)} | "
                     f"{ratio(bd, 'best Debian peer')} | {ratio(ba, 'AVX2-capped pip PyTorch')} |")
    L += ["", "### Share of each path's FMA peak (medians; peak measured in the same binary)", "",
          "| path | peak 1t GFLOP/s | QKV 1t | fc_o 1t | core 1x4096 1t | module 1x4096 1t | module demo 1t |",
          "|---|---|---|---|---|---|---|"]
    for isa in PATHS:
        peak = find(gemm[isa], r"fma_peak/.*threads:1")
        p1 = rate(peak) if peak else 0

        def pct(runs, prefix):
            r = find(runs, prefix)
            return f"{100 * common.note(data, f'{isa} {prefix}: share of the FMA peak', rate(r) / p1):.0f}%" if r and p1 else "-"
        L.append(f"| {isa} | {p1:.0f} | {pct(gemm[isa], r'qkv/.*/threads:1')} | {pct(gemm[isa], r'fc_o/.*/threads:1')} | "
                 f"{pct(core[isa], r'core/B:1/N:4096/threads:1')} | {pct(sdpa[isa], r'table/long/threads:1')} | "
                 f"{pct(sdpa[isa], r'table/demo/threads:1')} |")
    L += ["", "### Built without -march (-O2, as distributions build) against -O3 -march=native", "",
          "| case | native | -O2 | ratio |", "|---|---|---|---|"]
    for case, idx, prefix in (("demo, 1 thread", 0, "table/demo/threads:1$"), ("1x4096, 1 thread", 0, "table/long/threads:1$"),
                              ("decoding step, 4095 cached", 1, "decode/step/cache:4095")):
        n = find(builds["native"][idx], prefix)
        g = find(builds["generic"][idx], prefix)
        if n and g:
            L.append(f"| {case} | {stats(n)[0]:.3f} / {stats(n)[1]:.3f} | {stats(g)[0]:.3f} / {stats(g)[1]:.3f} | "
                     f"{common.note(data, f'{case}: -O2 / native', stats(g)[1] / stats(n)[1]):.2f}x |")
    return L
