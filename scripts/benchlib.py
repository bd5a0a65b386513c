"""What the benchmark scripts share: running a command, running a Google Benchmark executable and reading its
JSON (every repetition of every case by name), the CPU's name and flags, a results table's runner (its
arguments, its sdpa benchmark, its pip peer, its header), and replacing one marked section of
bench/RESULTS.md."""
import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys

_SUFFIX = re.compile(r"(/iterations:[0-9]+)?(/process_time)?/real_time$")
_MS = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}


def cpu(wanted):
    """The CPU's model name and which of the flags `wanted` /proc/cpuinfo lists (in wanted's order)."""
    model, flags = platform.processor(), set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model in ("", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    return model, [f for f in wanted if f in flags]


def run(cmd, **kw):
    print("+", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def build_benchmarks(source, build, targets, options=()):
    """Configures `build` as a Release build of the benchmarks only (no tests, no examples) and builds
    `targets` with 2 jobs."""
    run(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DSDPA_BUILD_TESTS=OFF",
         "-DSDPA_BUILD_EXAMPLES=OFF", "-DSDPA_BUILD_BENCHMARKS=ON", *options], stdout=subprocess.DEVNULL)
    run(["cmake", "--build", build, "--target", *targets, "-j", "2"], stdout=subprocess.DEVNULL)


def load(path):
    """(case name -> list of its runs' JSON records, the run's context); aggregates are left out."""
    with open(path) as f:
        data = json.load(f)
    runs = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        runs.setdefault(_SUFFIX.sub("", b.get("run_name", b["name"])), []).append(b)
    return runs, data.get("context", {})


def bench(exe, flt, reps, out, extra=()):
    """Runs exe's cases matching flt reps times each (JSON to out) and loads them."""
    run([exe, f"--benchmark_filter={flt}", f"--benchmark_repetitions={reps}", "--benchmark_min_time=0.5",
         f"--benchmark_out={out}", "--benchmark_out_format=json", *extra], stdout=subprocess.DEVNULL)
    return load(out)


def ms(record):
    """A run's real time in milliseconds."""
    return record["real_time"] * _MS[record["time_unit"]]


def times(runs):
    """case name -> real times in ms, one per repetition."""
    return {name: [ms(b) for b in records] for name, records in runs.items()}


def replace_section(path, begin, end, lines):
    """Writes begin, lines, end into path in place of the section between the markers (appended if absent)."""
    text = open(path).read() if os.path.exists(path) else ""
    section = "\n".join([begin] + lines + [end])
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


# ---- A runner that writes one bench/results/<name>.md: sdpa's benchmark, then a pip peer in a venv ----

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def runner_args(script, results, repetitions, peer):
    """The arguments of scripts/<script>, which writes bench/results/<results>: --build, --build-dir, --venv
    (`peer` says what runs there), --repetitions and --out. Returns (args, the command as typed)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true", help="configure and build build-bench first")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--venv", help=f"a virtual environment with torch (pip): {peer} in the same run")
    ap.add_argument("--repetitions", type=int, default=repetitions)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", results))
    args = ap.parse_args()
    return args, f"python3 scripts/{script} " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def run_ours(args, target, extra=()):
    """Builds (with --build) and runs bench/<target>, every case args.repetitions times (extra: more of its
    flags): (its runs, case name -> (min, median) ms)."""
    if args.build:
        build_benchmarks(ROOT, args.build_dir, [target])
    exe = os.path.join(args.build_dir, "bench", target)
    runs, _ = bench(exe, ".", args.repetitions, os.path.join(args.build_dir, target + ".json"), extra)
    return runs, {name: (min(t), statistics.median(t)) for name, t in times(runs).items()}


def run_peer(args, peer, *extra):
    """Runs bench/peers/<peer> with args.venv's python (nothing without --venv); it prints one JSON object per
    line. Returns (name -> (min_ms, median_ms), name -> error, the torch version it reported)."""
    found, errors, version = {}, {}, None
    if not args.venv:
        return found, errors, version
    py = os.path.join(args.venv, "bin", "python")
    out = subprocess.run([py, os.path.join(ROOT, "bench", "peers", peer), *extra], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        r = json.loads(line)
        version = r.get("torch", version)
        if "min_ms" in r:
            found[r["name"]] = (r["min_ms"], r["median_ms"])
        elif "error" in r:
            errors[r["name"]] = r["error"]
    return found, errors, version


def header(title, script, flags, command, repetitions, torch_version):
    """A results file's first lines: its title, who writes it, the machine and the flags of `flags` it has,
    the date, the command, what the times are (`repetitions`) and the peer's PyTorch."""
    model, present = cpu(flags)
    return [f"# {title}", "", f"Written by scripts/{script}; do not edit by hand.", "",
            f"- machine: {model}, {os.cpu_count()} cores; flags: {' '.join(present)}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            f"- command: `{command}` ({repetitions}, min / median ms)",
            f"- PyTorch: {torch_version or 'not run (no --venv)'} from pip, torch.set_num_threads as the case says"]


def write_results(path, lines):
    """Writes a results file (and prints it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
