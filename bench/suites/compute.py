"""Compute::kBf16 against kFloat on each bfloat16 path (compute_bench); PyTorch's f32 / bf16 SDPA and module.

Runs bench/compute_bench (Compute::kBf16 against kFloat on every bfloat16 path this CPU runs: AMX,
AVX512_BF16, emulated; the (1, 8, 4096, 64) forward and backward and the demo module, beside the float FMA
and bfloat16 peaks), bench/decode_bench's int8 and bf16 cache steps at batch 8, and, with --venv, PyTorch's
float32 and bfloat16 SDPA and demo module from pip (bench/peers/compute_peer.py) in the same run; the page
gives min and median per case and the ratios issue 49 asks for.

    python3 bench/run.py --suite compute --build --venv /tmp/venv [--repetitions 5]
"""

import os

from suites import common

TITLE = "Compute::kBf16 against kFloat and PyTorch (bench/compute_bench.cpp, bench/peers/compute_peer.py)"
PATHS = ["float", "emulated", "avx512_bf16", "amx"]


def add_arguments(ap):
    common.runner_arguments(ap, 5, "PyTorch's cases")


def measure(args):
    cases = common.run_ours(args, "compute_bench")
    torch, _, torch_version = common.run_peer(args, "compute_peer.py", "--repetitions", str(2 * args.repetitions))
    # Decoding over an int8 cache: its keys' scores in integer products (VNNI where the CPU has it) against
    # the bfloat16 cache's step and the read bound of each step's bytes (decode_bench, same run).
    if args.build:
        common.build_benchmarks(common.ROOT, args.build_dir, ["decode_bench"])
    decode_flt = "decode/(read/)?storage/kv:(int8|bf16)/weights:f32/cache:4095/batch:8/"
    druns, _ = common.bench(os.path.join(args.build_dir, "bench", "decode_bench"), decode_flt, args.repetitions,
                            os.path.join(args.build_dir, "decode_bench_compute.json"),
                            ["--benchmark_enable_random_interleaving=true"])
    cases.update(common.cases_of_runs(druns))
    return {"repetitions": args.repetitions, "cases": cases, "torch": torch, "torch_version": torch_version,
            "vnni": bool(common.cpu(["avx512_vnni"])[1])}


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def render(data):
    cases = data["cases"]
    ours = {name: common.pair(rec) for name, rec in cases.items()}
    torch = {name: common.pair(rec) for name, rec in data["torch"].items()}
    peaks = {}
    for name, rec in cases.items():
        if name.startswith("peak/"):
            counters = rec.get("counters", {})
            if "GFLOPs" in counters:
                peaks[name] = max(counters["GFLOPs"])
            elif "FLOPS" in counters:
                peaks[name] = max(counters["FLOPS"]) * 1e-9
    lines = [f"- {data['repetitions']} repetitions of each sdpa case, min / median ms",
             f"- PyTorch: {data['torch_version'] or 'not run (no --venv)'} from pip, torch.set_num_threads as the case says"]
    lines += ["", "## Peaks (1 thread, GFLOP/s)", "", "| instruction | GFLOP/s |", "|---|---:|"]
    for name in sorted(peaks):
        lines.append(f"| {name[len('peak/'):]} | {peaks[name]:.0f} |")
    amx_peak = peaks.get("peak/bf16/amx")

    def flops_attention(causal):
        return 4.0 * 8 * 4096 * 4096 * 64 * (0.5 if causal else 1.0)

    demo_flops = 2.0 * 50 * 49 * 512 * (4 * 8 * 64) + 4.0 * 50 * 8 * 49 * 49 * 64
    for title, rows in (("Attention, (1, 8, 4096, 64), sdpa::attention", [(c, t) for c in (0, 1) for t in (1, 2)]),
                        ("Backward, (1, 8, 4096, 64), sdpa::attention_backward (PyTorch: forward + backward)",
                         [("backward", t) for t in (1, 2)]),
                        ("The demo module, (50, 49, 512), h 8, d_k 64, eval", [(None, t) for t in (1, 2)])):
        lines += ["", f"## {title}", "",
                  "| case | kFloat | kBf16 emulated | kBf16 avx512_bf16 | kBf16 amx | PyTorch f32 | PyTorch bf16 | "
                  "best kBf16 / kFloat | best kBf16 / PyTorch bf16 | best kBf16 GFLOP/s (% AMX peak) |",
                  "|---|---|---|---|---|---|---|---:|---:|---:|"]
        for causal, threads in rows:
            if causal == "backward":
                ours_name = lambda p: f"backward/N:4096/compute:{p}/threads:{threads}"  # noqa: E731
                torch_name = lambda d: f"backward/N:4096/dtype:{d}/threads:{threads}"  # noqa: E731
                label, flops = f"backward, {threads} thread(s)", 10.0 * 8 * 4096 * 4096 * 64
            elif causal is None:
                ours_name = lambda p: f"demo/compute:{p}/threads:{threads}"  # noqa: E731
                torch_name = lambda d: f"demo/dtype:{d}/threads:{threads}"  # noqa: E731
                label, flops = f"demo, {threads} thread(s)", demo_flops
            else:
                ours_name = lambda p: f"attention/N:4096/causal:{causal}/compute:{p}/threads:{threads}"  # noqa: E731
                torch_name = lambda d: f"attention/N:4096/causal:{causal}/dtype:{d}/threads:{threads}"  # noqa: E731
                label, flops = f"{'causal' if causal else 'full'}, {threads} thread(s)", flops_attention(causal)
            cells = []
            for p in PATHS:
                t = ours.get(ours_name(p))
                cells.append("-" if t is None else f"{t[0]:.2f} / {t[1]:.2f}")
            for d in ("f32", "bf16"):
                t = torch.get(torch_name(d))
                cells.append("-" if t is None else f"{t[0]:.2f} / {t[1]:.2f}")
            bf16 = [ours[ours_name(p)][0] for p in PATHS[1:] if ours_name(p) in ours]
            best = min(bf16) if bf16 else None
            base = (ours.get(ours_name("float")) or (None,))[0]
            peer = (torch.get(torch_name("bf16")) or (None,))[0]
            speed = f"{common.note(data, f'{label}: kFloat / best kBf16', base / best):.2f}x" if best and base else "-"
            vs_torch = (f"{common.note(data, f'{label}: PyTorch bf16 / best kBf16', peer / best):.2f}x"
                        if best and peer else "-")
            gflops = flops / (best * 1e-3) / 1e9 if best else None
            of_peak = f" ({100 * gflops / (amx_peak * threads):.0f}%)" if gflops and amx_peak else ""
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {speed} | {vs_torch} | {fmt(gflops)}{of_peak} |")
    lines += ["", "Ratios use the minima; \"best kBf16\" is the fastest bfloat16 path of the run (the one "
              "sdpa chooses by default on this CPU is the highest it runs: amx, then avx512_bf16)."]

    # The softmax a forward cannot skip, against issue 49's AMX target (4x kFloat's speed).
    floor = ours.get("floor/softmax/N:4096")
    if floor:
        lines += ["", "## The softmax floor, (1, 8, 4096, 64), 1 thread", "",
                  "floor/softmax/N:4096: the forward's 8 x 4096 x 4096 scores through simd::row_max and "
                  "simd::exp_shifted_sum alone, on a row in L1 (no product, no packing, no rounding).", "",
                  f"- softmax alone: {floor[0]:.2f} / {floor[1]:.2f} ms"]
        base = ours.get("attention/N:4096/causal:0/compute:float/threads:1")
        amx = ours.get("attention/N:4096/causal:0/compute:amx/threads:1")
        if base:
            share = common.note(data, "softmax floor / (kFloat / 4)", floor[0] / (base[0] / 4))
            lines.append(f"- the AMX target's time, kFloat / 4: {base[0] / 4:.2f} ms; the softmax alone takes "
                         f"{100 * share:.0f}% of it")
        if amx:
            lines.append(f"- the amx forward: {amx[0]:.2f} ms, of which the softmax alone would be "
                         f"{100 * floor[0] / amx[0]:.0f}%")

    def decode_case(kv, read):
        prefix = f"decode/{'read/' if read else ''}storage/kv:{kv}/weights:f32/cache:4095/batch:8/"
        return next((ours[k] for k in ours if k.startswith(prefix)), None)

    int16_peak = peaks.get("peak/int16/vpdpwssd")
    lines += ["", "## Decoding, int8 cache, batch 8 x 4095 cached tokens (bench/decode_bench.cpp)", "",
              f"d_model 512, h 8, kv_heads 8, d_k 64, float weights, 1 thread; int8 keys' products on "
              f"{'vpdpwssd zmm (AVX512_VNNI)' if data['vnni'] else 'this CPU’s integer path'}; "
              "the read bound sums the step's bytes (cache, int8's scales, the four weight matrices) in the same run.",
              "", "| cache | step | read bound | step / bound | scores GOP/s (% vpdpwssd peak) |", "|---|---|---|---:|---:|"]
    score_ops = 2.0 * 8 * 8 * 4095 * 64
    for kv in ("int8", "bf16"):
        st, rb = decode_case(kv, False), decode_case(kv, True)
        if st is None:
            continue
        gops = score_ops / (st[0] * 1e-3) / 1e9
        of_peak = f" ({100 * gops / int16_peak:.1f}%)" if int16_peak and kv == "int8" else ""
        lines.append(f"| {kv} | {st[0]:.3f} / {st[1]:.3f} | "
                     + (f"{rb[0]:.3f} / {rb[1]:.3f} | {common.note(data, f'decode {kv} step / read bound', st[0] / rb[0]):.2f}x"
                        if rb else "- | -")
                     + f" | {gops:.1f}{of_peak} |")
    i8, b16 = decode_case("int8", False), decode_case("bf16", False)
    if i8 and b16:
        lines += ["", f"- int8 step / bf16 step: {common.note(data, 'decode bf16 step / int8 step', b16[0] / i8[0]):.2f}x "
                  "faster (minima)"]
    return lines
