"""Programmable attention (flex_bench) against the fixed options and separate calls; PyTorch's flex_attention.

Runs bench/flex_bench (causal as a mask with built-in and lambda plans against `causal = true`, 8 packed
documents against 8 separate calls, T5 buckets as a score function against a dense bias, plan building at
32768, a 16-draft tree step) and, with --venv, PyTorch's flex_attention from pip (bench/peers/flex_peer.py:
eager and torch.compile) in the same run; the page gives min and median per case and the ratios issue 47
asks for.

    python3 bench/run.py --suite flex --build --venv /tmp/venv [--repetitions 3]
"""

from suites import common

TITLE = "Programmable attention (bench/flex_bench.cpp, bench/peers/flex_peer.py)"


def add_arguments(ap):
    common.runner_arguments(ap, 3, "PyTorch's flex_attention")


def measure(args):
    cases = common.run_ours(args, "flex_bench")
    torch, torch_errors, torch_version = common.run_peer(args, "flex_peer.py", "--n", "4096", "--repetitions",
                                                         str(args.repetitions))
    return {"repetitions": args.repetitions, "cases": cases, "torch": torch, "torch_errors": torch_errors,
            "torch_version": torch_version}


def cell(t):
    return "-" if t is None else f"{t[0]:.2f} / {t[1]:.2f}"


def render(data):
    ours = {name: common.pair(rec) for name, rec in data["cases"].items()}
    torch = {name: common.pair(rec) for name, rec in data["torch"].items()}
    torch_errors = data["torch_errors"]

    def ratio(a, b, key):
        if a is None or b is None:
            return "-"
        return f"{common.note(data, key, a[0] / b[0]):.2f}x"

    lines = [f"- {data['repetitions']} repetitions of each case, min / median ms",
             f"- PyTorch: {data['torch_version'] or 'not run (no --venv)'} from pip, torch.set_num_threads as the case says",
             "- float32, sdpa::attention on (1, 8, N, 64) head tensors (d_model 512's heads)", ""]

    def row(label, *cells):
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for t in (1, 2):
        th = f"/threads:{t}"
        lines += [f"## {t} thread(s)", "", "### Causal written three ways, N 8192", "",
                  "| pass | options.causal | flex::causal + plan | lambda + block_mask_from | builtin / fixed | lambda / fixed |",
                  "|---|---|---|---|---:|---:|"]
        for p in ("fwd", "bwd"):
            f, b, l = (ours.get(f"flex/causal/{h}/N:8192/{p}{th}") for h in ("fixed", "builtin", "lambda"))
            row(p, cell(f), cell(b), cell(l), ratio(b, f, f"causal {p} builtin / fixed{th}"),
                ratio(l, f, f"causal {p} lambda / fixed{th}"))
        lines += ["", "### 8 documents of 1024 in one sequence of 8192, forward", "",
                  "| document & causal + plan | 8 causal calls of 1024 | causal over 8192 | plan / separate | dense / plan |",
                  "|---|---|---|---:|---:|"]
        d, s, c = (ours.get(f"flex/document/{h}/N:8192/fwd{th}") for h in ("builtin", "separate", "dense_causal"))
        row(cell(d), cell(s), cell(c), ratio(d, s, f"document plan / separate{th}"),
            ratio(c, d, f"document dense / plan{th}"))
        lines += ["", "### T5 buckets (32, max distance 128), N 4096, no mask", "",
                  "| pass | flex::t5_buckets | dense (1, 8, N, N) bias | score / dense bias |", "|---|---|---|---:|"]
        for p in ("fwd", "bwd"):
            sc, db = (ours.get(f"flex/t5/{h}/N:4096/{p}{th}") for h in ("score", "dense_bias"))
            row(p, cell(sc), cell(db), ratio(sc, db, f"t5 {p} score / dense bias{th}"))
        lines += ["", "### Building a plan from a generic lambda, N 32768", "",
                  "| mask | block_mask_from | one forward with the plan | build / forward |", "|---|---|---|---:|"]
        for m in ("causal", "document"):
            pb, fw = ours.get(f"flex/plan/{m}/N:32768{th}"), ours.get(f"flex/plan_forward/{m}/N:32768{th}")
            row(m, cell(pb), cell(fw), "-" if pb is None or fw is None
                else f"{100 * common.note(data, f'plan {m} build / forward{th}', pb[0] / fw[0]):.1f}%")
        lines += ["", "### Against PyTorch's flex_attention, N 4096, forward", "",
                  "| case | sdpa | PyTorch eager | PyTorch torch.compile | PyTorch best / sdpa | PyTorch backward on the CPU |",
                  "|---|---|---|---|---:|---|"]
        for case in ("causal", "document", "sliding", "prefix_lm", "t5"):
            ours_t = ours.get(f"flex/peer/{case}/N:4096{th}")
            modes = {m: torch.get(f"flex/{case}/N:4096/mode:{m}{th}") for m in ("eager", "compile")}
            errs = {m: torch_errors.get(f"flex/{case}/N:4096/mode:{m}{th}") for m in ("eager", "compile")}
            peer = [x for x in modes.values() if x is not None]
            best = min(peer) if peer else None
            bwd = []
            for m in ("eager", "compile"):
                name = f"flex_backward/{case}/N:4096/mode:{m}{th}"
                if name in torch:
                    bwd.append(f"{m}: {torch[name][0]:.2f} ms")
                elif name in torch_errors:
                    bwd.append(f"{m}: none ({torch_errors[name][:60]})")
            row(case, cell(ours_t), cell(modes["eager"]) if modes["eager"] else ("failed" if errs["eager"] else "-"),
                cell(modes["compile"]) if modes["compile"] else ("failed: " + errs["compile"][:60] if errs["compile"] else "-"),
                ratio(best, ours_t, f"PyTorch {case} best / sdpa{th}"), "; ".join(bwd) or "-")
        lines += ["", "### A decoding step over a cache of 4096", "",
                  "| tree of 16 drafts, one call | 1 query | tree / single |", "|---|---|---:|"]
        tr, si = ours.get(f"flex/tree/tree/N:4096{th}"), ours.get(f"flex/tree/single/N:4096{th}")
        row(cell(tr), cell(si), ratio(tr, si, f"tree / single{th}"))
        lines.append("")
    return lines
