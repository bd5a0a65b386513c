"""sdpa against PyTorch and ONNX Runtime (Debian's and pip's) and the machine's limits; the README's table.

Measures, in one session, sdpa against the CPU peers a user would pick instead (PyTorch 2.6 and ONNX
Runtime 1.21 from Debian 13, in a chroot made by ../shared/peers/; with --venv also today's pip versions) and
against the machine's limits (the FMA peak of each instruction-set path, oneDNN's sgemm). The README's
performance table is rendered from this suite's JSON (`bench/run.py --readme`).

    /usr/bin/python3 bench/run.py --suite peers [--build] [--venv /tmp/venv] [--repetitions 5]

sdpa: bench/table_bench on the peers' configurations with their FLOP count, bench/gemm_bench on its best path
and with SDPA_ISA=avx2 (FMA peaks, sdpa::gemm and dnnl_sgemm on the demo's projection shapes). Peers: run.sh
CONFIG IMPL THREADS, impl seed (the original module in torch ops), sdpa2 (F.scaled_dot_product_attention), mha
(nn.MultiheadAttention), ort (the module exported to ONNX), ort_mha (ONNX Runtime's MultiHeadAttention op),
ort_dnnl (ORT's oneDNN provider); each prints its best of several runs. --venv: the same peer_perf.py run by
the virtual environment's python (pip install torch onnxruntime onnx), its versions printed and named in the
table. (ONNX Runtime's GroupQueryAttention, a causal decoder op, is measured by the isa and decoder suites.)
Needs root (the chroot) and Google Benchmark.
"""

import json
import os
import re
import statistics
import subprocess
import sys

from suites import common

ROOT = common.ROOT
TITLE = "Against the peers: PyTorch, ONNX Runtime, and the machine's limits (bench/table_bench.cpp, bench/gemm_bench.cpp)"
PEERS = os.path.join(os.path.dirname(ROOT), "shared", "peers", "run.sh")
CONFIGS = [("demo", "demo 50x49, d_k 512"), ("std", "50x49, d_k 64"), ("long", "1x4096, d_k 64"),
           ("long_causal", "1x4096 causal")]
IMPLS = [("seed", "PyTorch 2.6, module ops"), ("sdpa2", "PyTorch 2.6 SDPA"), ("ort", "ONNX Runtime 1.21"),
         ("ort_mha", "ORT MultiHeadAttention"), ("ort_dnnl", "ORT + oneDNN EP")]
PIP_IMPLS = ["seed", "sdpa2", "mha", "ort", "ort_mha"]  # the pip wheel of onnxruntime has no oneDNN provider
ORT_IMPLS, TORCH_IMPLS = ("ort", "ort_mha", "ort_dnnl"), ("seed", "sdpa2")
PIP_ORT_IMPLS, PIP_TORCH_IMPLS = ("ort", "ort_mha"), ("seed", "sdpa2", "mha")


DRY_RUN = [False]  # --report-only: read the last run's JSON files instead of running


def bench(exe, flt, reps, out, env=None):
    """The runs of exe's cases matching flt. The repetitions of all cases are interleaved in random order, so
    that the FMA peak registered in the same binary is measured over the same stretch of time as the cases
    it is compared with."""
    if DRY_RUN[0]:
        runs, context = common.load(out)
    else:
        saved = dict(os.environ)
        os.environ.update(env or {})
        try:
            runs, context = common.bench(exe, flt, reps, out, ("--benchmark_enable_random_interleaving=true",))
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return runs, context


def add_arguments(ap):
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--venv", default="", help="a virtual environment with pip's torch, onnxruntime and onnx")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: take the last run's files in the build dir (bench/run.py --render peers "
                         "rewrites the page from the suite's JSON)")


def measure(args):
    build = os.path.abspath(args.build_dir)
    if args.build:
        common.build_benchmarks(ROOT, build, ["table_bench", "gemm_bench"])
    b = os.path.join(build, "bench")
    if args.report_only:
        DRY_RUN[0] = True  # the JSON files of the last run are read instead
    # gemm_bench names its cases after the path the machine runs (sdpa_avx512, sdpa_avx2, ...); that path's
    # fma_peak/<isa> tells which. On an AVX-512 machine the AVX2 build is measured too (SDPA_ISA=avx2).
    gemm, context = bench(os.path.join(b, "gemm_bench"), "fma_peak|^(qkv|fc_o)/.*/(sdpa_[a-z0-9]+|eigen|dnnl_sgemm)/",
                          args.repetitions, os.path.join(build, "peers_gemm.json"))
    isa = next(m.group(1) for m in (re.match(r"fma_peak/([a-z0-9]+)", n) for n in gemm) if m)
    cases = common.cases_of_runs(gemm, "gemm:")
    if isa == "avx512":
        gemm2, _ = bench(os.path.join(b, "gemm_bench"), "fma_peak|^(qkv|fc_o)/.*/sdpa_avx2/", args.repetitions,
                         os.path.join(build, "peers_gemm_avx2.json"), {"SDPA_ISA": "avx2"})
        cases.update(common.cases_of_runs(gemm2, "gemm_avx2:"))
    table, _ = bench(os.path.join(b, "table_bench"), "fma_peak|table/", args.repetitions,
                     os.path.join(build, "peers_table.json"))
    cases.update(common.cases_of_runs(table, "table:"))

    peers_json = os.path.join(build, "peers_peers.json")
    peers = {}
    pip_info = []
    if args.report_only:
        with open(peers_json) as f:
            saved = json.load(f)
        peers = {tuple(k.split("|")[:2]) + (int(k.split("|")[2]),): tuple(v) for k, v in saved["results"].items()}
        info = saved["info"]
        pip_info = saved.get("pip_info", [])
    pip_python = os.path.join(args.venv, "bin", "python") if args.venv else ""
    peer_script = os.path.join(os.path.dirname(PEERS), "peer_perf.py")

    def measure_peer(cmd, key, env=None):
        try:
            out = common.run(cmd, capture_output=True, text=True, env=env).stdout
        except subprocess.CalledProcessError as e:
            print(f"peer {key}: failed: {e}", file=sys.stderr)
            return
        m = re.search(r"min_ms=([0-9.]+) gflops=([0-9.]+)", out)
        if m:
            peers[key] = (float(m.group(1)), float(m.group(2)))

    # Debian's and pip's builds alternate, configuration by configuration, over the same minutes.
    for cfg, _ in ([] if args.report_only else CONFIGS):
        for threads in (1, 2):
            for impl, _ in IMPLS:
                measure_peer(["bash", PEERS, cfg, impl, str(threads)], (cfg, impl, threads))
            for impl in (PIP_IMPLS if pip_python else []):
                measure_peer([pip_python, peer_script, cfg, impl, str(threads)], (cfg, "pip_" + impl, threads),
                             dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if not args.report_only:
        info = subprocess.run(["bash", PEERS, "--info"], capture_output=True, text=True).stdout.strip().splitlines()
        pip_info = (subprocess.run([pip_python, peer_script, "--info"], capture_output=True, text=True).stdout.strip().splitlines()
                    if pip_python else [])
        # Kept in the build dir too: the isa suite's --peers-from reads it.
        with open(peers_json, "w") as f:
            json.dump({"results": {f"{c}|{i}|{t}": v for (c, i, t), v in peers.items()}, "info": info,
                       "pip_info": pip_info}, f, indent=1)
    return {"repetitions": args.repetitions, "isa": isa, "host": context.get("host_name", "this machine"),
            "cases": cases,
            "peers": {f"{c}|{i}|{t}": {"min_ms": v[0], "gflops": v[1]} for (c, i, t), v in peers.items()},
            "info": info, "pip_info": pip_info}


# ---- From the JSON ----

def reps(rec):
    """A case's runs as (ms, GFLOP/s) (gemm_bench counts GFLOPs, the others FLOPS)."""
    c = rec.get("counters", {})
    rates = c.get("GFLOPs") or [x / 1e9 for x in c.get("FLOPS", [])] or [0.0] * len(rec["runs_ms"])
    return list(zip(rec["runs_ms"], rates))


class Run:
    """What the tables read: the runs of each binary, the peers' best times, their versions."""

    def __init__(self, data):
        cases = data["cases"]
        self.isa = data["isa"]
        self.isa_label = {"avx512": "AVX-512", "avx2": "AVX2"}.get(self.isa, self.isa)
        self.gemm = {k: reps(v) for k, v in common.group(cases, "gemm:").items()}
        self.gemm2 = {k: reps(v) for k, v in common.group(cases, "gemm_avx2:").items()} or None
        self.table = {k: reps(v) for k, v in common.group(cases, "table:").items()}
        self.peers = {}
        for k, v in data["peers"].items():
            c, i, t = k.split("|")
            self.peers[(c, i, int(t))] = (v["min_ms"], v["gflops"])
        self.info, self.pip_info = data["info"], data["pip_info"]
        pip_versions = {line.split()[0]: line.split()[1] for line in self.pip_info if len(line.split()) == 2}
        self.have_pip = any(i.startswith("pip_") for _, i, _ in self.peers)
        self.pip_torch, self.pip_ort = pip_versions.get("torch", "pip"), pip_versions.get("onnxruntime", "pip")
        debian = {line.split()[0]: line.split()[1] for line in self.info if len(line.split()) == 2}
        self.debian_torch = debian.get("torch", "2.6").split("+")[0]
        self.debian_ort = debian.get("onnxruntime", "1.21")
        self.peak, self.tpeak = self.peak_of(self.gemm, self.isa), self.peak_of(self.table, self.isa)
        self.peak2 = self.peak_of(self.gemm2, "avx2") if self.gemm2 else None
        self.top, self.ttop = self.best_peak(self.gemm, self.isa), self.best_peak(self.table, self.isa)

    @staticmethod
    def find(runs, pattern):
        return next(n for n in runs if re.search(pattern, n))

    @staticmethod
    def best(runs, name):  # (min ms, median ms, median GFLOP/s)
        r = runs[name]
        times = [t for t, _ in r]
        return min(times), statistics.median(times), statistics.median(g for _, g in r)

    # Each binary's own peak, the median of its repetitions (interleaved with the cases it is compared with:
    # median against median, over the same minutes; this VM's clock moves by 10% and more between runs).
    def peak_of(self, runs, isa):
        return {t: statistics.median(g for _, g in runs[self.find(runs, rf"fma_peak/{isa}/.*threads:{t}$")]) for t in (1, 2)}

    def best_peak(self, runs, isa):
        return {t: max(g for _, g in runs[self.find(runs, rf"fma_peak/{isa}/.*threads:{t}$")]) for t in (1, 2)}

    def peer_best(self, cfg, impls, t, pip=False):
        found = [self.peers[(cfg, ("pip_" if pip else "") + i, t)][0] for i in impls
                 if (cfg, ("pip_" if pip else "") + i, t) in self.peers]
        return min(found) if found else None


def render(data):
    r = Run(data)
    isa, isa_label, peers = r.isa, r.isa_label, r.peers
    gemm, gemm2, table = r.gemm, r.gemm2, r.table
    peak, tpeak, peak2, top, ttop = r.peak, r.tpeak, r.peak2, r.top, r.ttop
    best, find = r.best, r.find
    have_pip, pip_torch, pip_ort = r.have_pip, r.pip_torch, r.pip_ort
    lines = [f"On {data['host']}. sdpa's times: min / median of {data['repetitions']} runs (bench/table_bench, the "
             "peers' FLOP count); peers: their best of several runs (../shared/peers/run.sh, Debian 13's python3-torch "
             "and python3-onnxruntime in a chroot on this machine). d_model 512, h 8, float, eval, self-attention."]
    lines += ["", "Peers: " + "; ".join(x.strip() for x in r.info[:5] if x.strip() and not x.startswith("---")), ""]
    pip_labels = {"seed": f"PyTorch {pip_torch}, module ops", "sdpa2": f"PyTorch {pip_torch} SDPA",
                  "mha": f"PyTorch {pip_torch} nn.MultiheadAttention", "ort": f"ONNX Runtime {pip_ort}",
                  "ort_mha": f"ORT {pip_ort} MultiHeadAttention"}
    if have_pip:
        lines += ["Today's pip versions, the same peer_perf.py run by a virtual environment's python (--venv): "
                  + "; ".join(x.strip() for x in r.pip_info[:5] if x.strip() and not x.startswith("---")), ""]
    lines += ["FMA peak, measured by each benchmark binary beside its cases (fma_peak, repetitions interleaved "
              "with the cases' in random order; median, and best in brackets): "
              f"products {isa_label} {peak[1]:.0f} ({top[1]:.0f}) GFLOP/s on 1 core, {peak[2]:.0f} ({top[2]:.0f}) on 2; "
              + (f"AVX2 build {peak2[1]:.0f} and {peak2[2]:.0f}; " if peak2 else "")
              + f"module runs {tpeak[1]:.0f} ({ttop[1]:.0f}) and "
              f"{tpeak[2]:.0f} ({ttop[2]:.0f}). Each % of the FMA peak below is a median rate over the median peak "
              "of the same binary's run.", ""]
    lines += ["## Matrix products (the demo's projection shapes)", "",
              f"| product | threads | sdpa::gemm ({isa_label}) | % of FMA peak | Eigen | dnnl_sgemm |"
              + (" sdpa::gemm AVX2 build | % of AVX2 peak |" if gemm2 else ""),
              "|---|---|---|---|---|---|" + ("---|---|" if gemm2 else "")]
    for shape, label in (("qkv", "fused QKV 2450 x 512 x 12288"), ("fc_o", "fc_o 2450 x 4096 x 512")):
        for t in (1, 2):
            ours = best(gemm, find(gemm, rf"^{shape}/.*/sdpa_{isa}/threads:{t}"))[2]
            eig = best(gemm, find(gemm, rf"^{shape}/.*/eigen/threads:{t}"))[2]
            try:
                dn = f"{best(gemm, find(gemm, rf'^{shape}/.*/dnnl_sgemm/threads:{t}'))[2]:.0f}"
            except StopIteration:
                dn = "—"
            share = common.note(data, f"{shape} product, {t} thread(s): share of the {isa_label} FMA peak", ours / peak[t])
            row = f"| {label} | {t} | {ours:.0f} GFLOP/s | {100 * share:.0f}% | {eig:.0f} | {dn} |"
            if gemm2:
                a2 = best(gemm2, find(gemm2, rf"^{shape}/.*/sdpa_avx2/threads:{t}"))[2]
                share2 = common.note(data, f"{shape} product, AVX2 build, {t} thread(s): share of the AVX2 FMA peak",
                                     a2 / peak2[t])
                row += f" {a2:.0f} | {100 * share2:.0f}% |"
            lines.append(row)
    lines += ["", "## The module", "",
              "GFLOP/s and % of the FMA peak are sdpa's medians; the ratios compare sdpa's fastest run with the peers' "
              "fastest (they report their best of several runs).", "",
              "| config | threads | sdpa (min / median) | GFLOP/s | % of FMA peak | "
              + " | ".join(label for _, label in IMPLS) + " | vs ORT (best of its 3) | vs PyTorch 2.6 (best of 2) |"
              + ("".join(f" {pip_labels[i]} |" for i in PIP_IMPLS) + f" vs ORT {pip_ort} | vs PyTorch {pip_torch} |"
                 if have_pip else ""),
              "|---|---|---|---|---|" + "---|" * len(IMPLS) + "---|---|"
              + ("---|" * (len(PIP_IMPLS) + 2) if have_pip else "")]
    # (GFLOP/s and % of the peak from sdpa's median; the ratios compare sdpa's best run with the peers' best.)
    targets = []
    nan = float("nan")
    for cfg, label in CONFIGS:
        for t in (1, 2):
            mn, md, g = best(table, f"table/{cfg}/threads:{t}")
            cells = []
            for impl, _ in IMPLS:
                p = peers.get((cfg, impl, t))
                cells.append(f"{p[0]:.0f} ms" if p else "—")
            ort, torch = r.peer_best(cfg, ORT_IMPLS, t), r.peer_best(cfg, TORCH_IMPLS, t)
            # Best against best: the peers report their fastest run, so sdpa's fastest run is compared.
            vs_ort = common.note(data, f"{label}, {t} thread(s): ONNX Runtime 1.21's best / sdpa's", ort / mn if ort else nan)
            vs_torch = common.note(data, f"{label}, {t} thread(s): PyTorch 2.6's best / sdpa's", torch / mn if torch else nan)
            pct = common.note(data, f"{label}, {t} thread(s): share of the FMA peak", g / tpeak[t])
            row = (f"| {label} | {t} | {mn:.0f} / {md:.0f} ms | {g:.0f} | {100 * pct:.0f}% | "
                   + " | ".join(cells) + f" | {vs_ort:.2f}x | {vs_torch:.2f}x |")
            vs_pip_ort = vs_pip_torch = nan
            if have_pip:
                pcells = [f"{peers[(cfg, 'pip_' + i, t)][0]:.0f} ms" if (cfg, "pip_" + i, t) in peers else "—"
                          for i in PIP_IMPLS]
                pip_ort_t = r.peer_best(cfg, PIP_ORT_IMPLS, t, pip=True)
                pip_torch_t = r.peer_best(cfg, PIP_TORCH_IMPLS, t, pip=True)
                vs_pip_ort = common.note(data, f"{label}, {t} thread(s): ONNX Runtime {pip_ort}'s best / sdpa's",
                                         pip_ort_t / mn if pip_ort_t else nan)
                vs_pip_torch = common.note(data, f"{label}, {t} thread(s): PyTorch {pip_torch}'s best / sdpa's",
                                           pip_torch_t / mn if pip_torch_t else nan)
                row += " " + " | ".join(pcells) + f" | {vs_pip_ort:.2f}x | {vs_pip_torch:.2f}x |"
            lines.append(row)
            targets.append((label, t, vs_ort, vs_torch, 100 * pct, vs_pip_ort, vs_pip_torch))
    # What the 1.2x target asks of this machine: the time it allows and the end-to-end rate that means,
    # against the best peak of the run and the best single product (one matrix product, no attention).
    qkv_dnnl = None
    try:
        qkv_dnnl = max(g for _, g in gemm[find(gemm, r"^qkv/.*/dnnl_sgemm/threads:1")])
    except StopIteration:
        pass
    qkv_ours = max(g for _, g in gemm[find(gemm, rf"^qkv/.*/sdpa_{isa}/threads:1")])
    lines += ["", "## What 1.2x ahead of ONNX Runtime takes", "",
              "The time the target allows (ONNX Runtime's best / 1.2), the end-to-end rate that time means (the "
              "peers' FLOP count over it), as % of the best FMA peak the run measured; beside sdpa's best run. "
              "For scale, the fastest single product of the run, one thread, the fused QKV shape: sdpa::gemm "
              f"{100 * qkv_ours / top[1]:.0f}%"
              + (f", oneDNN's sgemm {100 * qkv_dnnl / top[1]:.0f}%" if qkv_dnnl else "")
              + " of the best peak.", "",
              "| config | threads | ONNX Runtime's best | 1.2x allows | rate needed | % of the best peak | sdpa's best | its % |",
              "|---|---|---|---|---|---|---|---|"]
    for cfg, label in CONFIGS:
        for t in (1, 2):
            runs = table[f"table/{cfg}/threads:{t}"]
            gflop = runs[0][0] * runs[0][1] / 1e3  # ms * GFLOP/s: the case's count
            ort = r.peer_best(cfg, ORT_IMPLS, t)
            if not ort:
                continue
            allowed = ort / 1.2
            rate = gflop / allowed * 1e3
            mn = min(x for x, _ in runs)
            lines.append(f"| {label} | {t} | {ort:.0f} ms | {allowed:.0f} ms | {rate:.0f} GFLOP/s | "
                         f"{100 * rate / ttop[t]:.0f}% | {mn:.0f} ms | {100 * gflop / mn * 1e3 / ttop[t]:.0f}% |")
    lines += ["", "| target | measured | required | |", "|---|---|---|---|"]
    for label, t, vs_ort, vs_torch, pct, vs_pip_ort, vs_pip_torch in targets:
        lines.append(f"| {label}, {t} thread{'s' if t > 1 else ''}: faster than ONNX Runtime's best | {vs_ort:.2f}x | >= 1.2x | "
                     f"{'**PASS**' if vs_ort >= 1.2 else '**FAIL**'} |")
        lines.append(f"| {label}, {t} thread{'s' if t > 1 else ''}: faster than PyTorch 2.6's best | {vs_torch:.2f}x | > 1x | "
                     f"{'**PASS**' if vs_torch > 1.0 else '**FAIL**'} |")
        if have_pip:
            lines.append(f"| {label}, {t} thread{'s' if t > 1 else ''}: faster than ONNX Runtime {pip_ort}'s best | "
                         f"{vs_pip_ort:.2f}x | >= 1.2x | {'**PASS**' if vs_pip_ort >= 1.2 else '**FAIL**'} |")
            lines.append(f"| {label}, {t} thread{'s' if t > 1 else ''}: faster than PyTorch {pip_torch}'s best | "
                         f"{vs_pip_torch:.2f}x | > 1x | {'**PASS**' if vs_pip_torch > 1.0 else '**FAIL**'} |")
    for shape in ("qkv", "fc_o"):
        # The targets of the issue that set them: 85% of the peak on AVX-512, 80% on AVX2.
        ours = best(gemm, find(gemm, rf"^{shape}/.*/sdpa_{isa}/threads:1"))[2]
        need = 0.85 if isa == "avx512" else 0.80
        lines.append(f"| {shape} product, 1 thread, % of the {isa_label} FMA peak | {100 * ours / peak[1]:.0f}% | "
                     f">= {100 * need:.0f}% | {'**PASS**' if ours >= need * peak[1] else '**FAIL**'} |")
        if gemm2:
            a2 = best(gemm2, find(gemm2, rf"^{shape}/.*/sdpa_avx2/threads:1"))[2]
            lines.append(f"| {shape} product, AVX2 build, 1 thread, % of the AVX2 FMA peak | {100 * a2 / peak2[1]:.0f}% | >= 80% | "
                         f"{'**PASS**' if a2 >= 0.80 * peak2[1] else '**FAIL**'} |")
    for label, t, _, _, pct, _, _ in targets:
        if t == 1:
            need = 70 if "causal" in label else 75
            lines.append(f"| {label}, 1 thread, end to end, % of the FMA peak | {pct:.0f}% | >= {need}% | "
                         f"{'**PASS**' if pct >= need else '**FAIL**'} |")
    return lines


def readme_table(data):
    """The README's performance table (bench/run.py --readme): per configuration and thread count sdpa's best
    run, its median's share of the FMA peak, each peer's best implementation and the ratios of the bests."""
    r = Run(data)
    m = data["machine"]

    def short(version):  # "2.15.0+cu132" -> "2.15"
        return ".".join(version.split("+")[0].split(".")[:2])
    peers = [("ONNX Runtime " + short(r.debian_ort), ORT_IMPLS, False),
             ("PyTorch " + short(r.debian_torch), TORCH_IMPLS, False)]
    if r.have_pip:
        peers += [(f"ONNX Runtime {short(r.pip_ort)} (pip)", PIP_ORT_IMPLS, True),
                  (f"PyTorch {short(r.pip_torch)} (pip)", PIP_TORCH_IMPLS, True)]
    lines = [f"From [bench/results/peers.md](bench/results/peers.md) ({data['date']}, `{data['command']}`): {m['model']}, "
             f"{m['cores']} cores, FMA peak ({r.isa_label}) {r.tpeak[1]:.0f} GFLOP/s on one core in that run. sdpa: its "
             f"best of {data['repetitions']} runs, the % of the peak from its median; each peer: its best implementation's "
             "best run (causal: the peak share counts the visible pairs).", "",
             "| config | threads | sdpa | % of FMA peak | " + " | ".join(name for name, _, _ in peers) + " | "
             + " | ".join("vs " + name.replace("ONNX Runtime", "ORT").replace(" (pip)", "") for name, _, _ in peers) + " |",
             "|---|---|---|---|" + "---|" * (2 * len(peers))]
    for cfg, label in CONFIGS:
        for t in (1, 2):
            mn, _, g = r.best(r.table, f"table/{cfg}/threads:{t}")
            bests = [r.peer_best(cfg, impls, t, pip) for _, impls, pip in peers]
            lines.append(f"| {label} | {t} | {mn:.0f} ms | {100 * g / r.tpeak[t]:.0f}% | "
                         + " | ".join(f"{b:.0f} ms" if b else "—" for b in bests) + " | "
                         + " | ".join(f"{b / mn:.2f}x" if b else "—" for b in bests) + " |")
    return lines
