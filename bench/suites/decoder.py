"""Today's decoder options (decoder_bench) against ONNX Runtime's GroupQueryAttention; issue 22's targets.

Measures today's decoder options (grouped-query heads, rotary embeddings, softcap, sinks, their backward:
bench/decoder_bench, d_model 512, h 8, d_k 64, 1 thread) against ONNX Runtime's GroupQueryAttention with the
projections around it (bench/peers/ort_gqa_peer.py: Debian 13's ONNX Runtime 1.21 in the peers' chroot and
today's pip version from --venv), in rounds that alternate sdpa and the peers, with the targets of issue 22
checked on the medians.

    /usr/bin/python3 bench/run.py --suite decoder --build [--venv /tmp/venv] [--rounds 5]

Needs root for the Debian 13 chroot (../shared/peers/debian13_root.sh).
"""

import json
import os
import statistics
import subprocess

from suites import common

ROOT = common.ROOT
TITLE = "Today's decoders against ONNX Runtime's GroupQueryAttention (bench/decoder_bench.cpp, bench/peers/ort_gqa_peer.py)"
PEERS = os.path.join(os.path.dirname(ROOT), "shared", "peers")


def peer_runs(label, venv):
    """One run of ort_gqa_peer.py: {case: (min_ms, median_ms)} and the ORT version."""
    script = os.path.join(ROOT, "bench", "peers", "ort_gqa_peer.py")
    if label == "debian":
        root = os.environ.get("TMPDIR", "/tmp") + "/peers-debian13"
        os.makedirs(root + "/opt/peers", exist_ok=True)
        subprocess.run(["cp", script, root + "/opt/peers/ort_gqa_peer.py"], check=True)
        cmd = ["bash", os.path.join(PEERS, "debian13_root.sh"), "python3", "/opt/peers/ort_gqa_peer.py"]
    else:
        cmd = [os.path.join(venv, "bin", "python"), script]
    out = subprocess.run(cmd + ["--repetitions", "20"], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    rows, version = {}, None
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows[r["case"]] = (r["min_ms"], r["median_ms"])
            version = r["ort"]
    return rows, version


def add_arguments(ap):
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--venv", default="", help="a virtual environment with onnx and onnxruntime (today's pip)")
    ap.add_argument("--rounds", type=int, default=5)


def measure(args):
    build = os.path.abspath(args.build_dir)
    if args.build:
        common.build_benchmarks(ROOT, build, ["decoder_bench"])
    exe = os.path.join(build, "bench", "decoder_bench")
    labels = ["debian"] + (["pip"] if args.venv else [])
    ours, peers, versions = {}, {}, {}
    for r in range(args.rounds):
        out = os.path.join(build, f"decoder_round{r}.json")
        common.run([exe, "--benchmark_repetitions=1", "--benchmark_min_time=0.5", f"--benchmark_out={out}",
                    "--benchmark_out_format=json"], stdout=subprocess.DEVNULL)
        runs, _ = common.load(out)
        for name, records in runs.items():
            ours.setdefault(name.replace("decoder/", ""), []).extend(common.ms(b) for b in records)
        for label in labels:
            rows, version = peer_runs(label, args.venv)
            versions[label] = version
            for case, v in rows.items():
                peers.setdefault((label, case), []).append(v)
    # A peer's case: the minimum of its rounds' minima, the median of their medians; every round's pair kept.
    peer_cases = {f"{label}|{case}": {"min_ms": min(m for m, _ in v), "median_ms": statistics.median(d for _, d in v),
                                      "rounds": [list(x) for x in v]}
                  for (label, case), v in peers.items()}
    return {"rounds": args.rounds, "labels": labels, "versions": versions,
            "cases": {k: common.case(v) for k, v in ours.items()}, "peers": peer_cases}


def render(data):
    labels, versions = data["labels"], data["versions"]
    med = {k: v["median_ms"] for k, v in data["cases"].items()}
    lo = {k: v["min_ms"] for k, v in data["cases"].items()}
    peer_med = {tuple(k.split("|", 1)): v["median_ms"] for k, v in data["peers"].items()}
    peer_lo = {tuple(k.split("|", 1)): v["min_ms"] for k, v in data["peers"].items()}
    names = {"debian": f"ORT {versions.get('debian') or '1.21'} GQA", "pip": f"ORT {versions.get('pip') or '(pip)'} GQA"}
    L = [f"{data['rounds']} rounds, each one "
         "run of every decoder_bench case then 20 runs of each ONNX Runtime case (bench/peers/ort_gqa_peer.py: "
         "GroupQueryAttention with MatMul + Add projections around it, past key/value bound in place); min / "
         "median in ms over all rounds. d_model 512, h 8, d_k 64, float, 1 thread.", "",
         "| case | sdpa | " + " | ".join(names[x] for x in labels) + " |", "|---|---|" + "---|" * len(labels)]
    for case in sorted(med):
        cells = []
        for label in labels:
            key = (label, case)
            cells.append(f"{peer_lo[key]:.3f} / {peer_med[key]:.3f}" if key in peer_med else "-")
        L.append(f"| {case} | {lo[case]:.3f} / {med[case]:.3f} | " + " | ".join(cells) + " |")

    def ratio(a, b):
        return med[a] / med[b] if a in med and b in med else float("nan")

    def vs(label, case):
        key = (label, case)
        return peer_med[key] / med[case] if key in peer_med and case in med else float("nan")

    checks = [
        ("step at 4095 cached, kv_heads 2 / kv_heads 8", ratio("step/kv:2/rotary:0/cache:4095", "step/kv:8/rotary:0/cache:4095"), "<=", 0.45),
        ("step kv_heads 2, rotary / without", ratio("step/kv:2/rotary:1/cache:4095", "step/kv:2/rotary:0/cache:4095"), "<=", 1.1),
        ("forward 1x4096 causal, kv_heads 2 + rotary / kv_heads 8 without", ratio("forward/kv:2/rotary:1/N:4096", "forward/kv:8/rotary:0/N:4096"), "<=", 0.9),
        ("forward 1x4096, softcap / plain", ratio("forward/softcap/N:4096", "forward/plain/N:4096"), "<=", 1.3),
        ("forward 1x4096, sinks / plain", ratio("forward/sinks/N:4096", "forward/plain/N:4096"), "<=", 1.03),
        ("backward 1x4096 kv_heads 2 + rotary / its forward (with state)", ratio("backward/kv:2/rotary:1/N:4096", "forward_state/kv:2/rotary:1/N:4096"), "<=", 3.5),
    ]
    for label in labels:
        checks.append((f"step kv_heads 2 + rotary: {names[label]} / sdpa", vs(label, "step/kv:2/rotary:1/cache:4095"), ">=", 2.0))
        checks.append((f"causal forward 1x4096 kv_heads 2 + rotary: {names[label]} / sdpa", vs(label, "forward/kv:2/rotary:1/N:4096"), ">=", 1.5))
    L += ["", "| target (issue 22, medians) | measured | required | |", "|---|---|---|---|"]
    for text, value, op, bound in checks:
        common.note(data, text, value)
        ok = value <= bound if op == "<=" else value >= bound
        L.append(f"| {text} | {value:.2f}x | {op} {bound}x | **{'PASS' if ok else 'FAIL'}** |")
    return L
