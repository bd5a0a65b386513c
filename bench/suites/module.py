"""The module against LibTorch 1.13 and sdpa::onednn (sdpa_bench), peak RSS, compile time; the first targets.

Steps: (optionally) configure and build build-bench with SDPA_BUILD_BENCHMARKS=ON; run sdpa_bench
(sdpa with Eigen products, the LibTorch peer, dnnl_sgemm) and sdpa_bench_onednn (sdpa::onednn) with
--benchmark_repetitions and JSON output; run sdpa_peak_rss once per (impl, N, causal) in a fresh process;
run bench/compile_time.sh; then take the min and the median of the repetitions per case and write the
tables, the PASS/FAIL of the targets (computed from the medians) and bench/seq_len.png.

Run it with /usr/bin/python3 (the interpreter with matplotlib) on a quiet machine:
    /usr/bin/python3 bench/run.py --suite module --build
A quick smoke run:
    /usr/bin/python3 bench/run.py --suite module --repetitions 1 --min-time 0.01 --max-n 1024 \\
        --filter 'sgemm|demo|long|causal' --out /tmp/module.md --plot /tmp/seq_len.png
"""

import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

from suites import common

ROOT = common.ROOT
TITLE = "sdpa vs LibTorch 1.13 vs oneDNN sgemm (bench/sdpa_bench.cpp, bench/peak_rss.cpp, bench/compile_time.sh)"
LONG_NS = [512, 1024, 2048, 4096, 8192, 16384]

# Issue targets (evaluated on medians).
DEMO_SPEEDUP_VS_TORCH = 3.0
DEMO_SGEMM_SHARE = 55.0
DEMO_ONEDNN_SGEMM_SHARE = 85.0
LONG_N = 4096
LONG_SPEEDUP_VS_TORCH = 10.0
LONG_SGEMM_SHARE = 40.0
RSS_N = 16384
RSS_LIMIT_MIB = 400.0
DEMO_THREAD_SCALING = 1.6
COMPILE_RATIO_LIMIT = 6.0


def log(msg):
    print(f"[bench/run.py --suite module] {msg}", file=sys.stderr, flush=True)


def run(cmd, commands, cwd=None, capture=False, check=True, env=None):
    """Runs cmd (list), records it for the page's commands; returns stdout when capture."""
    commands.append(shlex.join(cmd))
    log("$ " + shlex.join(cmd))
    if capture:
        p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, text=True, env=env)
    else:
        p = subprocess.run(cmd, cwd=cwd, env=env)
    if check and p.returncode != 0:
        raise SystemExit(f"command failed ({p.returncode}): {shlex.join(cmd)}")
    return p.stdout if capture else p.returncode


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True).stdout.strip()
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------
# Machine


def machine_info(build_dir):
    lscpu = {}
    for line in sh("LC_ALL=C lscpu").splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            lscpu[k.strip()] = v.strip()
    flags = set(lscpu.get("Flags", "").split())
    interesting = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
                   "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]
    info = {
        "model": lscpu.get("Model name", "?"),
        "cpus": lscpu.get("CPU(s)", "?"),
        "threads_per_core": lscpu.get("Thread(s) per core", "?"),
        "cores_per_socket": lscpu.get("Core(s) per socket", "?"),
        "sockets": lscpu.get("Socket(s)", "?"),
        "hypervisor": lscpu.get("Hypervisor vendor", ""),
        "caches": ", ".join(f"{k} {lscpu[k]}" for k in ("L1d cache", "L2 cache", "L3 cache") if k in lscpu),
        "flags": " ".join(f for f in interesting if f in flags),
        "mem": sh("free -g | awk '/^Mem:/ {print $2\" GiB\"}'"),
        "kernel": sh("uname -sr"),
        "compiler": sh("c++ --version | head -1"),
        "git": sh(f"git -C {shlex.quote(ROOT)} rev-parse --short HEAD") +
               (" (uncommitted changes)" if sh(f"git -C {shlex.quote(ROOT)} status --porcelain") else ""),
    }
    # Which BLAS LibTorch's matmuls and linears run on: Debian's libtorch links libblas.so.3, whose
    # provider is chosen by update-alternatives (netlib reference BLAS unless OpenBLAS/BLIS/MKL is installed).
    blas = ""
    exe = os.path.join(build_dir, "bench", "sdpa_bench")
    if os.path.exists(exe):
        for line in sh(f"ldd {shlex.quote(exe)}").splitlines():
            m = re.match(r"\s*(libblas\.so\.\S+|libopenblas\S*|libmkl_rt\S*|libblis\S*)\s*=>\s*(\S+)", line)
            if m:
                real = os.path.realpath(m.group(2))
                pkg = sh(f"dpkg -S {shlex.quote(real)} 2>/dev/null | cut -d: -f1")
                blas = f"{m.group(1)} -> {real}" + (f" (package {pkg})" if pkg else "")
                break
    info["torch_blas"] = blas
    return info


# --------------------------------------------------------------------------------------------------
# Google Benchmark JSON


class Case:
    def __init__(self, name):
        self.name = name
        self.real_ms = []
        self.cpu_ms = []
        self.gflop = None
        self.threads = None

    @property
    def min_ms(self):
        return min(self.real_ms)

    @property
    def median_ms(self):
        return statistics.median(self.real_ms)

    def gflops(self, stat="median"):
        t = self.median_ms if stat == "median" else self.min_ms
        return self.gflop / (t / 1e3) if self.gflop and t > 0 else None

    @property
    def cpu_share(self):
        """Median CPU time / real time: about 1 per thread when the case had its cores to itself."""
        return statistics.median(c / r for c, r in zip(self.cpu_ms, self.real_ms) if r > 0)

    def record(self):
        """The case in the suite's JSON."""
        return common.case(self.real_ms, cpu_ms=self.cpu_ms, gflop=self.gflop)

    @classmethod
    def of_record(cls, name, rec):
        c = cls(name)
        c.real_ms, c.cpu_ms, c.gflop = list(rec["runs_ms"]), list(rec.get("cpu_ms", [])), rec.get("gflop")
        c.threads = split_name(name)[2]
        return c


def to_ms(value, unit):
    return value * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def load_cases(path):
    with open(path) as f:
        data = json.load(f)
    cases = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        # Google Benchmark appends the options it was given: /repeats:K, /process_time, /real_time...
        name = re.sub(r"(/(repeats|min_time|iterations):[^/]+|/process_time|/real_time|/manual_time)+$", "",
                      b.get("run_name", b["name"]))
        c = cases.setdefault(name, Case(name))
        c.real_ms.append(to_ms(b["real_time"], b["time_unit"]))
        c.cpu_ms.append(to_ms(b["cpu_time"], b["time_unit"]))
        c.gflop = b.get("GFLOP", c.gflop)
        c.threads = split_name(name)[2]
    return data.get("context", {}), cases


def split_name(name):
    """'long/N:4096/sdpa/threads:1' -> ('long/N:4096', 'sdpa', 1); sgemm -> ('sgemm', 'dnnl', t)."""
    m = re.match(r"^(.*)/([a-z_]+)/threads:(\d+)$", name)
    if name.startswith("sgemm/"):
        t = int(re.search(r"threads:(\d+)", name).group(1))
        return "sgemm", "dnnl", t
    if not m:
        return name, "?", 0
    return m.group(1), m.group(2), int(m.group(3))


def index_cases(cases):
    """{(config, impl, threads): Case}"""
    return {split_name(n): c for n, c in cases.items()}


# --------------------------------------------------------------------------------------------------
# Formatting


def fmt_ms(case):
    if case is None:
        return "—"
    if len(case.real_ms) == 1:
        return f"{case.median_ms:.2f}"
    return f"{case.median_ms:.2f} ({case.min_ms:.2f})"


def fmt(x, spec=".2f", suffix=""):
    return "—" if x is None else f"{x:{spec}}{suffix}"


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def config_order(config):
    groups = ["demo", "standard", "long", "causal", "cross"]
    g = config.split("/")[0]
    n = re.search(r"N:(\d+)", config)
    return (groups.index(g) if g in groups else len(groups), int(n.group(1)) if n else 0, config)


def contention_mark(case):
    """A '*' when a 1-thread case got clearly less than a whole CPU (a busy machine). The binaries measure
    the process's CPU time; with 2 threads serial parts lower it too, so only 1-thread cases are judged."""
    if case is None or not case.cpu_ms or case.threads != 1:
        return ""
    return "*" if case.cpu_share < 0.9 else ""


# --------------------------------------------------------------------------------------------------
# The suite


def add_arguments(ap):
    ap.add_argument("--build", action="store_true", help="configure and build the benchmarks first")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--jobs", type=int, default=1, help="build parallelism (default 1)")
    ap.add_argument("--repetitions", type=int, default=5, help="--benchmark_repetitions (default 5)")
    ap.add_argument("--torch-repetitions", type=int, default=3,
                    help="repetitions of the LibTorch cases (default 3: seconds-long, stable forwards)")
    ap.add_argument("--min-time", type=float, default=None,
                    help="--benchmark_min_time (default: the binaries' 0.5 s per case)")
    ap.add_argument("--filter", default=None, help="--benchmark_filter regex for both binaries")
    ap.add_argument("--max-n", type=int, default=16384, help="longest long/causal sequence")
    ap.add_argument("--torch-max-n", type=int, default=4096,
                    help="longest sequence of the 1-thread LibTorch long/causal cases (at most 8192)")
    ap.add_argument("--torch-max-n-2t", type=int, default=1024,
                    help="longest sequence of the 2-thread LibTorch long/causal cases")
    ap.add_argument("--no-torch", action="store_true", help="no LibTorch cases or peak RSS")
    ap.add_argument("--skip-onednn", action="store_true", help="do not run sdpa_bench_onednn")
    ap.add_argument("--skip-peak-rss", action="store_true")
    ap.add_argument("--peak-rss-n", default=",".join(map(str, LONG_NS)),
                    help="sequence lengths of the peak RSS table")
    ap.add_argument("--torch-rss-max-n", type=int, default=4096,
                    help="longest sequence for LibTorch's peak RSS (its scores alone are 32 N^2 bytes)")
    ap.add_argument("--skip-compile-time", action="store_true")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: take the last run's files in BUILD_DIR/bench-results (bench/run.py --render "
                         "module rewrites the page from the suite's JSON)")
    ap.add_argument("--plot", default=os.path.join(ROOT, "bench", "seq_len.png"))


def measure(args):
    build = os.path.abspath(args.build_dir)
    bench_dir = os.path.join(build, "bench")
    out_dir = os.path.join(build, "bench-results")
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "run_meta.json")
    main_json = os.path.join(out_dir, "sdpa_bench.json")
    onednn_json = os.path.join(out_dir, "sdpa_bench_onednn.json")

    if args.report_only:
        with open(meta_path) as f:
            meta = json.load(f)
    else:
        meta = run_all(args, build, bench_dir, main_json, onednn_json)
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=1)
    context, main_cases = load_cases(main_json)
    cases = {f"sdpa_bench:{name}": c.record() for name, c in main_cases.items()}
    if os.path.exists(onednn_json):
        cases.update({f"sdpa_bench_onednn:{name}": c.record() for name, c in load_cases(onednn_json)[1].items()})
    return {"meta": meta, "machine_info": machine_info(build), "torch": context.get("torch", ""),
            "raw_json": out_dir, "cases": cases}


def run_all(args, build, bench_dir, main_json, onednn_json):
    """Builds (optionally) and runs everything; returns what the report needs besides the JSON files."""
    commands = []
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    t_start = time.time()

    if args.build:
        run(["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DSDPA_BUILD_BENCHMARKS=ON",
             "-DSDPA_BUILD_TESTS=OFF", "-DSDPA_BUILD_EXAMPLES=OFF"], commands)
        run(["cmake", "--build", build, "-j", str(args.jobs)], commands)

    def bench_cmd(exe, json_path, torch):
        cmd = [os.path.join(bench_dir, exe), f"--benchmark_repetitions={args.repetitions}",
               "--benchmark_out_format=json", f"--benchmark_out={json_path}",
               "--benchmark_display_aggregates_only=true", f"--sdpa_max_n={args.max_n}"]
        if args.min_time is not None:
            cmd.append(f"--benchmark_min_time={args.min_time}")
        if args.filter:
            cmd.append(f"--benchmark_filter={args.filter}")
        if torch:
            if args.no_torch:
                cmd.append("--sdpa_no_torch")
            else:
                cmd += [f"--sdpa_torch_max_n={args.torch_max_n}", f"--sdpa_torch_max_n_2t={args.torch_max_n_2t}",
                        f"--sdpa_torch_repetitions={args.torch_repetitions}"]
        return cmd

    # 1. The Eigen build, LibTorch and sgemm.
    run(bench_cmd("sdpa_bench", main_json, True), commands)

    # 2. The oneDNN backend.
    if os.path.exists(onednn_json):
        os.remove(onednn_json)
    if not args.skip_onednn and os.path.exists(os.path.join(bench_dir, "sdpa_bench_onednn")):
        run(bench_cmd("sdpa_bench_onednn", onednn_json, False), commands)

    # 3. Peak RSS, one fresh process per measurement.
    rss = []
    if not args.skip_peak_rss:
        rss_exe = os.path.join(bench_dir, "sdpa_peak_rss")
        torch_rss = os.path.exists(os.path.join(bench_dir, "sdpa_peak_rss_torch")) and not args.no_torch
        for n in [int(x) for x in args.peak_rss_n.split(",") if x]:
            for causal in (0, 1):
                impls = ["sdpa"] + (["torch"] if torch_rss and n <= args.torch_rss_max_n else [])
                for impl in impls:
                    out = run([rss_exe, impl, str(n), str(causal)], commands, capture=True, check=False)
                    try:
                        rss.append(json.loads(out.strip().splitlines()[-1]))
                        log(out.strip())
                    except (ValueError, IndexError):
                        log(f"peak RSS run failed for {impl} N={n} causal={causal}")

    # 4. Compile time.
    compile_out = ""
    if not args.skip_compile_time:
        compile_out = run(["bash", os.path.join(ROOT, "bench", "compile_time.sh"), "3"], commands, capture=True)
        print(compile_out, end="")

    load_after = os.getloadavg()
    return {
        "argv": sys.argv[1:],
        "started": started.isoformat(),
        "elapsed_s": time.time() - t_start,
        "load_before": load_before,
        "load_after": load_after,
        "commands": commands,
        "rss": rss,
        "compile_out": compile_out,
        "repetitions": args.repetitions,
        "torch_repetitions": None if args.no_torch else args.torch_repetitions,
    }




def render(data):
    """The page's body from the suite's JSON."""
    meta = data["meta"]
    info = data["machine_info"]
    started = datetime.datetime.fromisoformat(meta["started"])
    elapsed = meta["elapsed_s"]
    load_before, load_after = meta["load_before"], meta["load_after"]
    commands = meta["commands"]
    compile_out = meta["compile_out"]
    m = re.search(r"ratio:\s*([0-9.]+)", compile_out)
    compile_ratio = float(m.group(1)) if m else None
    rss = {(r["impl"], r["N"], r["causal"]): r for r in meta["rss"]}
    main_idx = index_cases({name: Case.of_record(name, rec)
                            for name, rec in common.group(data["cases"], "sdpa_bench:").items()})
    onednn_idx = index_cases({name: Case.of_record(name, rec)
                              for name, rec in common.group(data["cases"], "sdpa_bench_onednn:").items()})

    # ----------------------------------------------------------------------------------------------
    # Derived numbers

    def sgemm(idx, threads):
        return idx.get(("sgemm", "dnnl", threads))

    def share_of_sgemm(case, idx, threads, stat="median"):
        s = sgemm(idx, threads)
        if case is None or s is None:
            return None
        return 100.0 * case.gflops(stat) / s.gflops(stat)

    configs = sorted({k[0] for k in list(main_idx) + list(onednn_idx) if k[0] != "sgemm"}, key=config_order)

    # ----------------------------------------------------------------------------------------------
    # Targets

    targets = []

    def target(label, value, limit, cmp, unit="", spec=".2f"):
        if value is None:
            verdict = "MISSING"
        else:
            verdict = "PASS" if (value >= limit if cmp == ">=" else value <= limit if cmp == "<=" else
                                 value < limit) else "FAIL"
        common.note(data, label, value)
        targets.append((label, fmt(value, spec, unit), f"{cmp} {limit:g}{unit}", verdict))

    def get(idx, config, impl, threads):
        return idx.get((config, impl, threads))

    demo_s1, demo_t1 = get(main_idx, "demo", "sdpa", 1), get(main_idx, "demo", "torch", 1)
    demo_s2 = get(main_idx, "demo", "sdpa", 2)
    target("demo, 1 thread: LibTorch time / sdpa time", ratio(demo_t1 and demo_t1.median_ms,
                                                             demo_s1 and demo_s1.median_ms),
           DEMO_SPEEDUP_VS_TORCH, ">=", "x")
    target("demo, 1 thread: sdpa GFLOP/s as % of dnnl_sgemm (Eigen build)",
           share_of_sgemm(demo_s1, main_idx, 1), DEMO_SGEMM_SHARE, ">=", "%", ".1f")
    target("demo, 1 thread: sdpa::onednn GFLOP/s as % of dnnl_sgemm",
           share_of_sgemm(get(onednn_idx, "demo", "sdpa_onednn", 1), onednn_idx, 1),
           DEMO_ONEDNN_SGEMM_SHARE, ">=", "%", ".1f")
    for group in ("long", "causal"):
        cfg = f"{group}/N:{LONG_N}"
        s1, t1 = get(main_idx, cfg, "sdpa", 1), get(main_idx, cfg, "torch", 1)
        label = f"1x{LONG_N}{' causal' if group == 'causal' else ''}, 1 thread"
        target(f"{label}: LibTorch time / sdpa time", ratio(t1 and t1.median_ms, s1 and s1.median_ms),
               LONG_SPEEDUP_VS_TORCH, ">=", "x")
        target(f"{label}: sdpa GFLOP/s as % of dnnl_sgemm", share_of_sgemm(s1, main_idx, 1),
               LONG_SGEMM_SHARE, ">=", "%", ".1f")
    lc, ld = get(main_idx, f"causal/N:{LONG_N}", "sdpa", 1), get(main_idx, f"long/N:{LONG_N}", "sdpa", 1)
    target(f"1x{LONG_N}, 1 thread: causal time / non-causal time (causal faster)",
           ratio(lc and lc.median_ms, ld and ld.median_ms), 1.0, "<", "", ".3f")
    r = rss.get(("sdpa", RSS_N, 0))
    target(f"1x{RSS_N}: sdpa peak RSS (MiB)", r and r["peak_rss_mib"], RSS_LIMIT_MIB, "<=", " MiB", ".1f")
    target("demo: sdpa 2 threads vs 1 thread speedup", ratio(demo_s1 and demo_s1.median_ms,
                                                            demo_s2 and demo_s2.median_ms),
           DEMO_THREAD_SCALING, ">=", "x")
    target("compile time: demo.cpp / Tensor-only file", compile_ratio, COMPILE_RATIO_LIMIT, "<=", "x")

    # ----------------------------------------------------------------------------------------------
    # The page

    L = []
    L.append(f"- Date: {started:%Y-%m-%d %H:%M %Z} (took {elapsed / 60:.1f} min)")
    L.append(f"- Machine: {info['model']}, {info['cpus']} CPUs ({info['sockets']} socket x "
             f"{info['cores_per_socket']} cores x {info['threads_per_core']} threads/core)"
             + (f", {info['hypervisor']} guest" if info['hypervisor'] else "") + f", {info['mem']} RAM")
    L.append(f"- Caches: {info['caches']}")
    L.append(f"- ISA flags: {info['flags']}")
    L.append(f"- OS / compiler: {info['kernel']}; {info['compiler']}; sdpa at {info['git']}")
    torch_desc = data.get("torch", "")
    if torch_desc:
        backend = re.search(r"ATen parallel backend:\s*(.+)", torch_desc)
        torch_desc = torch_desc.split(";")[0] + (f", parallel backend {backend.group(1).strip()}" if backend else "")
    L.append(f"- LibTorch: {torch_desc or 'not built'}" + (f"; its BLAS: {info['torch_blas']}" if info['torch_blas'] else ""))
    if "netlib" in info["torch_blas"] or "libblas3" in info["torch_blas"]:
        L.append("  - **Note:** this LibTorch (Debian's libtorch 1.13) runs its float matmuls and linears on the "
                 "netlib *reference* BLAS selected by update-alternatives, not on MKL/OpenBLAS as pip wheels do, "
                 "so it is a slow baseline; installing an optimised libblas.so.3 provider (e.g. OpenBLAS) changes "
                 "the LibTorch columns.")
    L.append(f"- Load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
             f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}. 1-thread times marked * got less "
             "than 90% of a CPU (median process CPU time / real time): the machine was busy.")
    L.append(f"- Statistics: {meta['repetitions']} repetitions (LibTorch cases: "
             f"{meta['torch_repetitions'] or '—'}); times are the **median (min)** real "
             "time of one forward in ms; GFLOP/s and ratios use medians; PASS/FAIL is computed from medians.")
    L.append("- FLOPs: the module's useful multiply-adds x 2: the four projections (2 x rows x in x out each) "
             "and 2 x B x h x (visible query-key pairs) x (d_k + d_v) for the attention, where a causal mask "
             "leaves N(N+1)/2 of the N^2 pairs. LibTorch is credited with the same count.")
    L.append("- Configurations (d_model = 512, h = 8): demo = 50 x 49 tokens, d_k = d_v = 512, self-attention "
             "(q = k = v); standard = 8 x 256, d_k = d_v = 64, self-attention; long/N = 1 x N, d_k = d_v = 64, "
             "self-attention; causal/N = long/N with sdpa::causal_mask / torch.triu(ones, 1); cross = 8 x 256 "
             "queries over 8 x 1024 keys = values, d_k = d_v = 64. Threads: sdpa 1 = no device, 2 = "
             "Eigen::ThreadPoolDevice(2); LibTorch at::set_num_threads(1 / 2); sgemm omp_set_num_threads.")
    L.append("- Every LibTorch case is preceded (once per configuration) by a check that sdpa's and LibTorch's "
             "outputs agree to 1e-4 relative (max-norm) on the same inputs and weights; the benchmark aborts "
             "otherwise.\n")

    L.append("## Targets\n")
    L.append("| Target | Measured | Required | Result |")
    L.append("|---|---|---|---|")
    for t in targets:
        L.append(f"| {t[0]} | {t[1]} | {t[2]} | **{t[3]}** |")
    L.append("")

    # How far any implementation could get ahead of LibTorch here: the module's FLOPs at 100% of
    # dnnl_sgemm's rate (1 thread). A required ratio above this ceiling cannot be met on this machine.
    ceilings = []
    for label, cfg in (("demo", "demo"), (f"1x{LONG_N}", f"long/N:{LONG_N}"),
                       (f"1x{LONG_N} causal", f"causal/N:{LONG_N}")):
        s1, t1, g = get(main_idx, cfg, "sdpa", 1), get(main_idx, cfg, "torch", 1), sgemm(main_idx, 1)
        if s1 and t1 and g:
            gflop = s1.gflops("median") * s1.median_ms / 1000.0
            ideal_ms = 1000.0 * gflop / g.gflops("median")
            ceilings.append(f"| {label} | {gflop:.1f} | {ideal_ms:.0f} | {t1.median_ms:.0f} | "
                            f"{t1.median_ms / ideal_ms:.2f}x |")
    if ceilings:
        L.append("### The ceiling of the LibTorch ratios\n")
        L.append("The module's FLOPs at 100% of the 1-thread dnnl_sgemm rate measured above, against LibTorch's "
                 "median time: no implementation can beat LibTorch by more than the last column on this machine.\n")
        L.append("| Case | GFLOP | ms at 100% of sgemm | LibTorch, ms | highest possible LibTorch / sdpa |")
        L.append("|---|---|---|---|---|")
        L.extend(ceilings)
        L.append("")

    L.append("## dnnl_sgemm, the machine's limit\n")
    L.append("C = A B^T, M = 2450 (50 x 49 rows), K = 512, N = 4096: the demo's projection shape.\n")
    L.append("| Run | Threads | Time, ms | GFLOP/s |")
    L.append("|---|---|---|---|")
    for label, idx in (("sdpa_bench", main_idx), ("sdpa_bench_onednn", onednn_idx)):
        for t in (1, 2):
            s = sgemm(idx, t)
            if s:
                L.append(f"| {label} | {t} | {fmt_ms(s)}{contention_mark(s)} | {fmt(s.gflops(), '.1f')} |")
    L.append("")

    L.append("## sdpa_bench: sdpa (Eigen products) vs LibTorch\n")
    L.append("% of sgemm compares with dnnl_sgemm on the same number of threads from the same run; 2t/1t is "
             "sdpa's speedup from 1 to 2 threads.\n")
    L.append("| Case | Threads | sdpa, ms | LibTorch, ms | LibTorch / sdpa | sdpa GFLOP/s | % of sgemm | "
             "LibTorch GFLOP/s | sdpa 2t/1t |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for cfg in configs:
        for t in (1, 2):
            s, tt = get(main_idx, cfg, "sdpa", t), get(main_idx, cfg, "torch", t)
            if s is None and tt is None:
                continue
            s1, s2 = get(main_idx, cfg, "sdpa", 1), get(main_idx, cfg, "sdpa", 2)
            scale = ratio(s1 and s1.median_ms, s2 and s2.median_ms) if t == 2 else None
            L.append(f"| {cfg} | {t} | {fmt_ms(s)}{contention_mark(s)} | {fmt_ms(tt)}{contention_mark(tt)} | "
                     f"{fmt(ratio(tt and tt.median_ms, s and s.median_ms), '.2f', 'x')} | "
                     f"{fmt(s and s.gflops(), '.1f')} | {fmt(share_of_sgemm(s, main_idx, t), '.1f', '%')} | "
                     f"{fmt(tt and tt.gflops(), '.2f')} | {fmt(scale, '.2f', 'x')} |")
    L.append("")

    if onednn_idx:
        L.append("## sdpa_bench_onednn: sdpa::onednn (float projections via dnnl_sgemm)\n")
        L.append("% of sgemm uses the sgemm measured in this binary's run; vs Eigen is the Eigen build's time "
                 "divided by this one.\n")
        L.append("| Case | Threads | sdpa::onednn, ms | GFLOP/s | % of sgemm | vs Eigen build | 2t/1t |")
        L.append("|---|---|---|---|---|---|---|")
        for cfg in configs:
            for t in (1, 2):
                o = get(onednn_idx, cfg, "sdpa_onednn", t)
                if o is None:
                    continue
                e = get(main_idx, cfg, "sdpa", t)
                o1, o2 = get(onednn_idx, cfg, "sdpa_onednn", 1), get(onednn_idx, cfg, "sdpa_onednn", 2)
                scale = ratio(o1 and o1.median_ms, o2 and o2.median_ms) if t == 2 else None
                L.append(f"| {cfg} | {t} | {fmt_ms(o)}{contention_mark(o)} | {fmt(o.gflops(), '.1f')} | "
                         f"{fmt(share_of_sgemm(o, onednn_idx, t), '.1f', '%')} | "
                         f"{fmt(ratio(e and e.median_ms, o.median_ms), '.2f', 'x')} | {fmt(scale, '.2f', 'x')} |")
        L.append("")

    if rss:
        L.append("## Peak RSS, one forward of 1 x N (d_model 512, d_k = d_v = 64, h = 8), 1 thread\n")
        L.append("`sdpa_peak_rss IMPL N CAUSAL`, a fresh process per cell (a launcher forks and execs the "
                 "measurement, so no parent's memory is counted): getrusage ru_maxrss in MiB, including the "
                 "inputs (N x 512 floats) and, for causal, the (1, 1, N, N) bool mask the caller builds (N^2 "
                 "bytes, 256 MiB at 16384; the last column subtracts it). LibTorch runs in its own executable, "
                 "sdpa_peak_rss_torch, so that sdpa's numbers do not carry LibTorch's libraries; LibTorch's "
                 "RSS before allocating anything is given in brackets.\n")
        L.append("| N | sdpa | sdpa causal | LibTorch | LibTorch causal | causal mask | sdpa causal - mask |")
        L.append("|---|---|---|---|---|---|---|")
        for n in sorted({k[1] for k in rss}):
            def cell(impl, causal):
                r = rss.get((impl, n, causal))
                if r is None:
                    return "—"
                extra = f" [{r['startup_rss_mib']:.0f}]" if impl == "torch" else ""
                return f"{r['peak_rss_mib']:.1f}{extra}"
            rc = rss.get(("sdpa", n, 1))
            L.append(f"| {n} | {cell('sdpa', 0)} | {cell('sdpa', 1)} | {cell('torch', 0)} | {cell('torch', 1)} | "
                     f"{n * n / 2**20:.1f} | {fmt(rc and rc['peak_rss_mib'] - rc['mask_mib'], '.1f')} |")
        L.append("")

    if compile_out:
        L.append("## Compile time\n")
        L.append("`bench/compile_time.sh`: the demo's CMake compile command (compile only), min of 3 runs, "
                 "against the same command on a file that only includes <unsupported/Eigen/CXX11/Tensor>.\n")
        L.append("```")
        L.append(compile_out.strip())
        L.append("```\n")
    if data.get("plot"):
        L.append("## Time vs sequence length\n")
        L.append(f"![forward time vs sequence length, 1 thread]({data['plot']})\n")

    L.append("## Commands\n")
    L.append("```")
    L.append(data["command"])
    L.extend(commands)
    L.append("```")
    L.append("\nRaw Google Benchmark JSON: " + data["raw_json"] + "/\n")
    return L


def after(args, data):
    """Plot: time vs sequence length, 1 thread (--plot), linked from the page."""
    main_idx = index_cases({name: Case.of_record(name, rec)
                            for name, rec in common.group(data["cases"], "sdpa_bench:").items()})
    plot_ok = False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker

        fig, ax = plt.subplots(figsize=(7, 5))
        xs = set()
        series = [("sdpa", "long", "sdpa", "C0", "-o"), ("sdpa, causal", "causal", "sdpa", "C0", "--s"),
                  ("LibTorch", "long", "torch", "C3", "-o"), ("LibTorch, causal", "causal", "torch", "C3", "--s")]
        for label, group, impl, color, style in series:
            pts = sorted((int(re.search(r"N:(\d+)", k[0]).group(1)), c.median_ms)
                         for k, c in main_idx.items() if k[0].startswith(group + "/N:") and k[1] == impl and k[2] == 1)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)
                xs.update(p[0] for p in pts)
                plot_ok = True
        if plot_ok:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sorted(xs))
            ax.set_xticklabels([str(x) for x in sorted(xs)])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xlabel("sequence length N (batch 1, d_model 512, h 8, d_k = d_v = 64)")
            ax.set_ylabel("forward time, ms (median)")
            ax.set_title("ScaledDotProductAttention, 1 thread")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
        plt.close(fig)
    except ImportError:
        log("matplotlib missing (apt-get install python3-matplotlib): no plot")
    if plot_ok:
        data["plot"] = os.path.relpath(os.path.abspath(args.plot), os.path.dirname(os.path.abspath(args.out)))
        log(f"wrote {args.plot}")
