"""The attention blocks of today's open models (models_bench), beside the FMA peak of the same run.

Runs bench/models_bench (DeepSeek V3's latent attention step absorbed against expanded, prefill with QK-norm,
NoPE + temperature tuning and the output gate against plain, one decoding step as Llama, Qwen3, Gemma 3 and
Llama 4 configure it), repetitions interleaved at random; the page gives min and median per case and the
ratios issue 48 asks for.

    python3 bench/run.py --suite models --build [--repetitions 3]
"""

from suites import common

TITLE = "The attention blocks of today's open models (bench/models_bench.cpp)"


def add_arguments(ap):
    common.runner_arguments(ap, 3, "nothing (no peer here)")


def measure(args):
    # Repetitions interleaved at random: the blocks compared share the same stretches of this VM's clock.
    cases = common.run_ours(args, "models_bench", ["--benchmark_enable_random_interleaving=true"])
    return {"repetitions": args.repetitions, "cases": cases}


def cell(t):
    return "-" if t is None else f"{t[0]:.2f} / {t[1]:.2f}"


def counter(cases, name, key, best=max):
    values = cases.get(name, {}).get("counters", {}).get(key, [])
    return best(values) if values else None


def render(data):
    cases = data["cases"]
    ours = {name: common.pair(rec) for name, rec in cases.items()}

    def ratio(a, b, key=None):
        if a is None or b is None:
            return "-"
        value = a[0] / b[0]
        if key:
            common.note(data, key, value)
        return f"{value:.2f}x"

    lines = [f"- {data['repetitions']} repetitions of each case, interleaved at random; min / median ms",
             "- float32; ratios of minima; % of the FMA peak: the case's best FLOP rate over the best peak/fma rate of "
             "the same run and thread count", ""]

    def row(*cells):
        lines.append("| " + " | ".join(cells) + " |")

    for t in (1, 2):
        th = f"/threads:{t}"
        peak = counter(cases, next((n for n in cases if n.startswith("peak/fma/") and n.endswith(th)), ""), "GFLOPs")
        lines += [f"## {t} thread(s)", "", f"FMA peak: {peak:.0f} GFLOP/s" if peak else "FMA peak: not measured", ""]
        # MLA.
        a, e, c, kvb = (ours.get(f"mla/{k}{th}") for k in ("absorbed/cache:4096", "expanded/cache:4096", "core/cache:4096",
                                                           "kv_b_token"))
        pct = lambda name: ("-" if not peak or counter(cases, name + th, "FLOPS") is None  # noqa: E731
                            else f"{100 * counter(cases, name + th, 'FLOPS') / 1e9 / peak:.0f}%")
        expanded_step = None if e is None or kvb is None else (e[0] + kvb[0], e[1] + kvb[1])
        lines += ["### DeepSeek V3's latent attention, one token, cache of 4096 (128 heads, kv_lora 512, rope 64, nope 128, "
                  "v 128)", "",
                  "| case | ms (min / median) | % FMA peak |", "|---|---|---:|"]
        row("absorbed: W_UK, multi-query attention over the latents, W_UV", cell(a), pct("mla/absorbed/cache:4096"))
        row("its multi-query attention alone (1.1 GFLOP)", cell(c), pct("mla/core/cache:4096"))
        row("kv_b_proj of one token (the weights both forms read per step)", cell(kvb), "-")
        row("expanded: attention over 128 heads of cached keys 192 / values 128", cell(e), pct("mla/expanded/cache:4096"))
        row("expanded + kv_b_proj of the appended token", cell(expanded_step), "-")
        lb = counter(cases, "mla/absorbed/cache:4096" + th, "cache_bytes", min)
        eb = counter(cases, "mla/expanded/cache:4096" + th, "cache_bytes", min)
        lines += ["", f"- absorbed step / expanded step: {ratio(expanded_step, a, f'mla expanded step / absorbed step{th}')} "
                  f"faster (attention alone: {ratio(e, a, f'mla expanded / absorbed attention{th}')})",
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
        row("+ per-head QK-norm", cell(p["qk_norm"]), ratio(p["qk_norm"], p["plain"], f"prefill qk_norm / plain{th}") + " of plain")
        row("plain without rotary (NoPE)", cell(p["plain_nope"]), "")
        row("NoPE + temperature tuning", cell(p["temperature"]),
            ratio(p["temperature"], p["plain_nope"], f"prefill temperature / nope{th}") + " of NoPE")
        row("+ output gate", cell(p["gate"]), ratio(p["gate"], p["plain"], f"prefill gate / plain{th}") + " of plain")
        row("fc_g's projection alone", cell(p["gate_projection"]), "")
        row("the gate less its projection", cell(gate_beyond),
            ratio(gate_beyond, p["plain"], f"prefill gate less its projection / plain{th}") + " of plain")
        lines += [""]
        # Decoding steps.
        d = {k: ours.get(f"decode/{k}/cache:4096{th}") for k in ("llama", "qwen3", "gemma3", "llama4")}
        lines += ["### One decoding step after 4096 tokens, d_model 2048, 16 heads of 128, 4 key heads", "",
                  "| block | ms (min / median) | / llama |", "|---|---|---:|"]
        for k in ("llama", "qwen3", "gemma3", "llama4"):
            row(k, cell(d[k]), ratio(d[k], d["llama"], f"decode {k} / llama{th}"))
        lines += [""]
    return lines
