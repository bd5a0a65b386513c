#!/usr/bin/env python3
"""Runs bench/models_bench (the attention blocks of today's open models, beside the FMA peak of the same run)
and writes bench/results/models.md: the machine, its CPU flags, the date, the command, min and median per
case and the ratios issue 48 asks for.

    python3 scripts/run_models_benchmarks.py --build [--repetitions 3]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

FLAGS = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]


def cell(t):
    return "-" if t is None else f"{t[0]:.2f} / {t[1]:.2f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a[0] / b[0]:.2f}x"


def counter(runs, name, key, best=max):
    records = runs.get(name, [])
    values = [r[key] for r in records if key in r]
    return best(values) if values else None


def main():
    args, command = benchlib.runner_args("run_models_benchmarks.py", "models.md", 3, "nothing (no peer here)")
    # Repetitions interleaved at random: the blocks compared share the same stretches of this VM's clock.
    runs, ours = benchlib.run_ours(args, "models_bench", ["--benchmark_enable_random_interleaving=true"])
    lines = benchlib.header("The attention blocks of today's open models (bench/models_bench.cpp)", "run_models_benchmarks.py",
                            FLAGS, command, f"{args.repetitions} repetitions of each case", None)
    lines = [line for line in lines if not line.startswith("- PyTorch")]
    lines += ["- float32; ratios of minima; % of the FMA peak: the case's best FLOP rate over the best peak/fma rate of "
              "the same run and thread count", ""]

    def row(*cells):
        lines.append("| " + " | ".join(cells) + " |")

    for t in (1, 2):
        th = f"/threads:{t}"
        peak = counter(runs, next((n for n in runs if n.startswith("peak/fma/") and n.endswith(th)), ""), "GFLOPs")
        lines += [f"## {t} thread(s)", "", f"FMA peak: {peak:.0f} GFLOP/s" if peak else "FMA peak: not measured", ""]
        # MLA.
        a, e, c, kvb = (ours.get(f"mla/{k}{th}") for k in ("absorbed/cache:4096", "expanded/cache:4096", "core/cache:4096",
                                                           "kv_b_token"))
        pct = lambda name: ("-" if not peak or counter(runs, name + th, "FLOPS") is None
                            else f"{100 * counter(runs, name + th, 'FLOPS') / 1e9 / peak:.0f}%")
        expanded_step = None if e is None or kvb is None else (e[0] + kvb[0], e[1] + kvb[1])
        lines += ["### DeepSeek V3's latent attention, one token, cache of 4096 (128 heads, kv_lora 512, rope 64, nope 128, "
                  "v 128)", "",
                  "| case | ms (min / median) | % FMA peak |", "|---|---|---:|"]
        row("absorbed: W_UK, multi-query attention over the latents, W_UV", cell(a), pct("mla/absorbed/cache:4096"))
        row("its multi-query attention alone (1.1 GFLOP)", cell(c), pct("mla/core/cache:4096"))
        row("kv_b_proj of one token (the weights both forms read per step)", cell(kvb), "-")
        row("expanded: attention over 128 heads of cached keys 192 / values 128", cell(e), pct("mla/expanded/cache:4096"))
        row("expanded + kv_b_proj of the appended token", cell(expanded_step), "-")
        lb = counter(runs, "mla/absorbed/cache:4096" + th, "cache_bytes", min)
        eb = counter(runs, "mla/expanded/cache:4096" + th, "cache_bytes", min)
        lines += ["", f"- absorbed step / expanded step: {ratio(expanded_step, a)} faster (attention alone: {ratio(e, a)})",
                  f"- cache bytes: latent {lb / 2**20:.1f} MiB = (512 + 64) x 4096 x 4, expanded {eb / 2**20:.1f} MiB "
                  f"({eb / lb:.0f}x)" if lb and eb else "- cache bytes: not measured", ""]
        # Prefill options.
        p = {k: ours.get(f"prefill/{k}/N:4096{th}") for k in ("plain", "qk_norm", "plain_nope", "temperature", "gate",
                                                             "gate_projection")}
        gate_beyond = None if None in (p["gate"], p["gate_projection"]) else (p["gate"][0] - p["gate_projection"][0],
                                                                               p["gate"][1] - p["gate_projection"][1])
        lines += ["### Prefill 1 x 4096, d_model 1024, 16 heads of 64, 8 key heads, causal", "",
                  "| block | ms (min / median) | against |", "|---|---|---:|"]
        row("plain (rotary)", cell(p["plain"]), "")
        row("+ per-head QK-norm", cell(p["qk_norm"]), ratio(p["qk_norm"], p["plain"]) + " of plain")
        row("plain without rotary (NoPE)", cell(p["plain_nope"]), "")
        row("NoPE + temperature tuning", cell(p["temperature"]), ratio(p["temperature"], p["plain_nope"]) + " of NoPE")
        row("+ output gate", cell(p["gate"]), ratio(p["gate"], p["plain"]) + " of plain")
        row("fc_g's projection alone", cell(p["gate_projection"]), "")
        row("the gate less its projection", cell(gate_beyond), ratio(gate_beyond, p["plain"]) + " of plain")
        lines += [""]
        # Decoding steps.
        d = {k: ours.get(f"decode/{k}/cache:4096{th}") for k in ("llama", "qwen3", "gemma3", "llama4")}
        lines += ["### One decoding step after 4096 tokens, d_model 2048, 16 heads of 128, 4 key heads", "",
                  "| block | ms (min / median) | / llama |", "|---|---|---:|"]
        for k in ("llama", "qwen3", "gemma3", "llama4"):
            row(k, cell(d[k]), ratio(d[k], d["llama"]))
        lines += [""]
    benchlib.write_results(args.out, lines)


if __name__ == "__main__":
    main()
