"""What the benchmark scripts share: running a command, running a Google Benchmark executable and reading its
JSON (every repetition of every case by name), the CPU's name and flags, and replacing one marked section of
bench/RESULTS.md."""
import json
import os
import platform
import re
import shlex
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
