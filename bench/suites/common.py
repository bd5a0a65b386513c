"""What the benchmark suites share: running a command, building bench/ and running a Google Benchmark
executable and reading its JSON (every repetition of every case by name), the CPU's name and flags, turning
runs into the results JSON's case records (min, median, every run, the counters), the pip peers, and the
page that bench/run.py writes from a suite's JSON (bench/results/<suite>.md)."""
import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys

# bench/suites/common.py -> the repository's root.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
# The CPU flags a results page names (those /proc/cpuinfo lists).
FLAGS = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
         "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"]

_SUFFIX = re.compile(r"(/iterations:[0-9]+)?(/process_time)?/real_time$")
_MS = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}
# A Google Benchmark record's own fields; the rest are the case's counters.
_FIELDS = {"name", "run_name", "run_type", "repetitions", "repetition_index", "threads", "iterations", "real_time",
           "cpu_time", "time_unit", "family_index", "per_family_instance_index", "aggregate_name", "aggregate_unit",
           "label", "error_occurred", "error_message"}


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


# ---- The results JSON: one record per case ----

def case(times_ms, **more):
    """A case's record in a results JSON: min and median ms, every run's ms, and `more` (lists of per-run
    counters, or anything else the suite keeps)."""
    times_ms = list(times_ms)
    rec = {"min_ms": min(times_ms), "median_ms": statistics.median(times_ms), "runs_ms": times_ms}
    rec.update(more)
    return rec


def case_of_records(records):
    """A case's record from its Google Benchmark runs: the times, CPU times and every numeric counter, one
    value per run."""
    counters = {}
    for r in records:
        for k, v in r.items():
            if k not in _FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool):
                counters.setdefault(k, []).append(v)
    return case([ms(r) for r in records], cpu_ms=[r["cpu_time"] * _MS[r["time_unit"]] for r in records],
                counters=counters)


def cases_of_runs(runs, prefix=""):
    """{prefix + name: case record} from load()'s runs."""
    return {prefix + name: case_of_records(records) for name, records in runs.items()}


def group(cases, prefix):
    """The cases whose key starts with `prefix`, by the rest of the key."""
    return {k[len(prefix):]: v for k, v in cases.items() if k.startswith(prefix)}


def pair(rec):
    """(min, median) ms of a case record, None for a missing one."""
    return None if rec is None else (rec["min_ms"], rec["median_ms"])


def note(data, key, value):
    """Keeps a ratio (or a target's measured value) that a page shows in the JSON's "ratios"; returns value."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        stored = None
    else:
        stored = value
    data.setdefault("ratios", {})[key] = stored
    return value


def git_revision():
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def document(suite, title, command, data):
    """A suite's results JSON: what was run where and when, then the suite's own data ("cases": name ->
    {min_ms, median_ms, runs_ms, ...}, and anything else it measured)."""
    model, flags = cpu(FLAGS)
    doc = {"suite": suite, "title": title,
           "machine": {"model": model, "cores": os.cpu_count(), "flags": flags},
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": command, "sdpa": git_revision()}
    doc.update(data)
    return doc


def page(doc, body):
    """A results page: its title, where it comes from, the machine, its flags, the date and the command, then
    the suite's body lines."""
    name = doc["suite"]
    m = doc["machine"]
    return [f"# {doc['title']}", "",
            f"Generated by `bench/run.py --suite {name}` from [{name}.json]({name}.json) (`bench/run.py --render {name}` "
            "rewrites it from the JSON); do not edit by hand.", "",
            f"- machine: {m['model']}, {m['cores']} cores; flags: {' '.join(m['flags'])}",
            f"- date: {doc['date']}",
            f"- command: `{doc['command']}`",
            f"- sdpa: {doc.get('sdpa', 'unknown')}", ""] + body


# ---- A suite with a pip peer: sdpa's benchmark, then a peer in a virtual environment ----

def runner_arguments(ap, repetitions, peer):
    """The options of the suites that run one benchmark and a pip peer: --build, --build-dir, --venv (`peer`
    says what runs there) and --repetitions."""
    ap.add_argument("--build", action="store_true", help="configure and build build-bench first")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--venv", help=f"a virtual environment with torch (pip): {peer} in the same run")
    ap.add_argument("--repetitions", type=int, default=repetitions)


def run_ours(args, target, extra=()):
    """Builds (with --build) and runs bench/<target>, every case args.repetitions times (extra: more of its
    flags): {case name: record}."""
    if args.build:
        build_benchmarks(ROOT, args.build_dir, [target])
    exe = os.path.join(args.build_dir, "bench", target)
    runs, _ = bench(exe, ".", args.repetitions, os.path.join(args.build_dir, target + ".json"), extra)
    return cases_of_runs(runs)


def run_peer(args, peer, *extra):
    """Runs bench/peers/<peer> with args.venv's python (nothing without --venv); it prints one JSON object per
    line. Returns (name -> {min_ms, median_ms}, name -> error, the torch version it reported)."""
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
            found[r["name"]] = {"min_ms": r["min_ms"], "median_ms": r["median_ms"]}
        elif "error" in r:
            errors[r["name"]] = r["error"]
    return found, errors, version


def arguments(prog, description):
    """A suite's argument parser."""
    return argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
