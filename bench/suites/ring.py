"""Ring attention over MPI (ring_bench): 2 ranks against one process, peak RSS per rank, a scaling model.

Measures ring attention over MPI (issue 26): bench/ring_bench's causal self-attention of one sequence (h 8,
d_k = d_v 64, float, 1 thread per rank) in one process and over 2 ranks of this machine, in rounds (each
round one run of each, interleaved), min / median over the rounds; the peak RSS per rank at 65536 tokens
against one process; a model of scaling to P machines from the measured compute rate and message sizes.
Issue 26's targets are checked on the medians.

    python3 bench/run.py --suite ring --build [--rounds 5]
"""

import json
import os
import statistics
import subprocess

from suites import common

ROOT = common.ROOT
TITLE = "Ring attention over MPI (bench/ring_bench.cpp)"
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
HEADS, DIM = 8, 64


def mpiexec(np, args, **kw):
    return common.run(["mpiexec", "--oversubscribe", "-np", str(np), *args], env=ENV, **kw)


def add_arguments(ap):
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory-tokens", type=int, default=65536)


def measure(args):
    build = os.path.abspath(args.build_dir)
    if args.build:
        common.build_benchmarks(ROOT, build, ["ring_bench"], ["-DSDPA_MPI=ON"])
    exe = os.path.join(build, "bench", "ring_bench")
    times, counters = {}, {}
    for r in range(args.rounds):
        for np, flt in ((1, "single"), (2, "ring")):
            out = os.path.join(build, f"ring_round{r}_{np}.json")
            mpiexec(np, [exe, f"--benchmark_filter={flt}", "--benchmark_repetitions=1", f"--benchmark_out={out}",
                         "--benchmark_out_format=json"], stdout=subprocess.DEVNULL)
            runs, _ = common.load(out)
            for name, records in runs.items():
                key = name.replace("/iterations:1", "").replace("/manual_time", "")
                times.setdefault(key, []).extend(common.ms(b) for b in records)
                for b in records:
                    c = counters.setdefault(key, {})
                    for k in ("wait_s", "message_bytes"):
                        c.setdefault(k, []).append(b.get(k, 0))
    memory = {}
    for np, mode in ((1, "single"), (2, "ring")):
        line = [x for x in mpiexec(np, [exe, "--memory", mode, str(args.memory_tokens)], capture_output=True,
                                   text=True).stdout.splitlines() if x.startswith("{")][0]
        memory[mode] = json.loads(line)
    return {"rounds": args.rounds, "memory_tokens": args.memory_tokens,
            "cases": {k: common.case(v, counters=counters.get(k, {})) for k, v in times.items()}, "memory": memory}


def render(data):
    cases = data["cases"]
    med = {k: v["median_ms"] for k, v in cases.items()}
    lo = {k: v["min_ms"] for k, v in cases.items()}
    wait = {k: statistics.median(v.get("counters", {}).get("wait_s", [0])) * 1e3 for k, v in cases.items()}
    tokens = data["memory_tokens"]

    L = [f"Open MPI over shared memory, `mpiexec --oversubscribe`: {data['rounds']} rounds; one "
         f"causal self-attention sequence of N tokens, batch 1, h {HEADS}, d_k = d_v {DIM}, float, 1 thread per rank; "
         "min / median in ms over the rounds. A ring time is its slowest rank's; `wait` is the largest time a rank spent "
         "in MPI waits (messages not yet there, sends not yet taken), the communication the work did not hide.", "",
         "| N | one process (sdpa::attention) | ring, 2 ranks, zigzag | wait | ring / one process | "
         "ring, 2 ranks, contiguous | wait |", "|---|---|---|---|---|---|---|"]
    for n in (4096, 16384):
        s, z, c = f"single/causal/{n}", f"ring/causal/zigzag/{n}", f"ring/causal/contiguous/{n}"
        if s not in med or z not in med:
            continue
        L.append(f"| {n} | {lo[s]:.0f} / {med[s]:.0f} | {lo[z]:.0f} / {med[z]:.0f} | {wait[z]:.0f} | "
                 f"{common.note(data, f'N {n}: zigzag ring / one process', med[z] / med[s]):.2f}x | "
                 f"{lo[c]:.0f} / {med[c]:.0f} | {wait[c]:.0f} |")
    ms_, mr = data["memory"]["single"], data["memory"]["ring"]
    single_peak, ring_peak = max(ms_["vmhwm_kib"]) / 1024, max(mr["vmhwm_kib"]) / 1024
    L += ["", f"Peak RSS (VmHWM) of one causal call at N = {tokens} (`mpiexec -np P ring_bench --memory "
          f"single|ring {tokens}`): one process {single_peak:.0f} MiB (q, k, v and the output: "
          f"{4 * tokens * HEADS * DIM * 4 / 2**20:.0f} MiB); ring over 2 ranks, each rank "
          + ", ".join(f"{x / 1024:.0f}" for x in mr["vmhwm_kib"]) + f" MiB: {ring_peak / single_peak:.2f}x (its rows of q, k, v "
          "and the output, four message buffers of 1024 rows of k and v, one block of partial output)."]

    # The scaling model.
    n = 16384
    s, z = f"single/causal/{n}", f"ring/causal/zigzag/{n}"
    flops = 4.0 * n * n / 2 * DIM * HEADS  # q.k and p.v over the visible half
    rate = flops / (med[s] / 1e3)
    message = cases[z].get("counters", {}).get("message_bytes", [0])[0]
    row_bytes = HEADS * 2 * DIM * 4
    L += ["", "A model of P machines, one rank each, from these measurements: a rank's step works its N / P queries "
          "against one message of B = 1024 keys, about half of them visible under causal zigzag, "
          f"4 d h N/P B / 2 flops at the compute rate F; the message ({message / 2**20:.1f} MiB: B rows of k and v, "
          f"{row_bytes} bytes a row) must cross the link in that time. Communication stays hidden while "
          "N / P >= bytes per row x F / (2 d h x bandwidth), i.e. N / P >= 4 F / bandwidth here, and the ring stops "
          f"hiding it below that. Measured F on one core of this machine: {rate / 1e9:.0f} GFLOP/s (the one-process "
          f"run at N = {n}); a node's F scales with its cores.", "",
          "| F of a rank | link | bandwidth | N / P below which communication shows | that N at P = 8 | that N at P = 64 |",
          "|---|---|---|---|---|---|"]
    for cores in (1, 32, 128):
        for link, bw in (("25 Gb/s Ethernet", 3.1e9), ("100 Gb/s InfiniBand", 12.5e9), ("400 Gb/s", 50e9)):
            f = rate * cores
            n_min = row_bytes * f / (2 * DIM * HEADS * bw)
            L.append(f"| {f / 1e12:.2f} TFLOP/s ({cores} core{'s' if cores > 1 else ''}) | {link} | {bw / 1e9:.1f} GB/s | "
                     f"{n_min:,.0f} | {8 * n_min:,.0f} | {64 * n_min:,.0f} |")
    L += ["", "The backward sends k, v and their dK, dV accumulators (twice the bytes) after each step's work, so its "
          "transfers are exposed: a rank waits one message time per step (not measured here)."]

    ratio = common.note(data, "2 ranks at N 16384 causal: ring / one process", med[z] / med[s])
    memory_ratio = common.note(data, f"peak RSS per rank at N {tokens}, 2 ranks / one process", ring_peak / single_peak)
    L += ["", "Issue 26 targets (medians):",
          f"- 2 ranks at N = 16384 causal, 1 thread each: ring {ratio:.2f}x one process (target <= 0.6x): "
          f"{'PASS' if ratio <= 0.6 else 'FAIL'}; waiting on MPI {wait[z]:.0f} ms of {med[z]:.0f} ms.",
          f"- Peak RSS per rank at N = {tokens} on 2 ranks: {memory_ratio:.2f}x one process "
          f"(target <= 0.6x): {'PASS' if memory_ratio <= 0.6 else 'FAIL'}."]
    return L
