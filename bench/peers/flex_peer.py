#!/usr/bin/env python3
"""PyTorch's side of the programmable-attention benchmark: torch.nn.attention.flex_attention.flex_attention
on float32 CPU tensors q, k, v of shape (1, 8, n, 64) (torch.randn, seed 0), forward under torch.no_grad(),
torch.set_num_threads(T), in two modes:
    eager    flex_attention called directly (on the CPU it materialises the (1, 8, n, n) scores);
    compile  torch.compile(flex_attention, dynamic=False), compiled by a warm-up call before timing
             (dynamo's caches are reset for every threads value and case, so each case compiles afresh).
Cases (q_idx, kv_idx the positions; masks built once, outside the timing, by
create_block_mask(mask_mod, 1, 1, n, n, device="cpu")):
    causal     kv <= q
    document   4 documents of n/4 tokens (doc = idx // (n // 4)), same document and causal
    sliding    causal window of 256: q - 255 <= kv <= q
    prefix_lm  prefix of n/4: kv < n/4 or kv <= q
    t5         score_mod score + table[h, bucket(kv - q)], the bucket computed inside the score_mod with
               torch ops by transformers' T5Attention._relative_position_bucket (bidirectional, 32
               buckets, max distance 128), table a (8, 32) float32 tensor; no mask
Building each block mask is timed as its own, mode-less case. Backward (forward + out.sum().backward(),
q, k, v requiring grad) is tried once per case and mode; if it runs it is timed like the forward, if not
the case carries the error. One JSON line per case on stdout (progress on stderr):
    {"name": "flex/causal/N:4096/mode:eager/threads:1", "min_ms": ..., "median_ms": ..., "torch": "..."}
    {"name": "flex/block_mask/causal/N:4096/threads:1", "min_ms": ..., "median_ms": ..., "torch": "..."}
    {"name": "flex_backward/causal/N:4096/mode:compile/threads:1", "error": "...", "torch": "..."}

    python3 bench/peers/flex_peer.py [--n 4096] [--threads 1 2] [--repetitions 5] [--modes eager compile]
"""

import argparse
import json
import math
import sys
import time
import traceback

import torch
import torch._dynamo
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from peerlib import timed

MAX_N = 8192  # eager materialises (1, 8, n, n) float32 scores: 2 GiB per tensor at 8192
CASES = ("causal", "document", "sliding", "prefix_lm", "t5")
HEADS, HEAD_DIM, WINDOW = 8, 64, 256
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def emit(name, result):
    record = {"name": name}
    record.update(result)
    record["torch"] = torch.__version__
    print(json.dumps(record), flush=True)


def describe(e):
    """Exception type and the first line of its message (and the next one if the first only introduces it)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return f"{type(e).__name__}: {text}"[:300]


def t5_bucket(relative_position, num_buckets=T5_BUCKETS, max_distance=T5_MAX_DISTANCE):
    """transformers' T5Attention._relative_position_bucket, bidirectional=True, on the tensors a score_mod sees."""
    num_buckets //= 2
    buckets = (relative_position > 0).to(torch.long) * num_buckets
    relative_position = torch.abs(relative_position)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.clamp(if_large, max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, if_large)


def make_case(case, n, table):
    """(mask_mod or None, score_mod or None) of a case."""
    doc_len, prefix = n // 4, n // 4
    if case == "causal":
        return (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx), None
    if case == "document":
        return (lambda b, h, q_idx, kv_idx:
                (q_idx // doc_len == kv_idx // doc_len) & (kv_idx <= q_idx)), None
    if case == "sliding":
        return (lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)), None
    if case == "prefix_lm":
        return (lambda b, h, q_idx, kv_idx: (kv_idx < prefix) | (kv_idx <= q_idx)), None
    if case == "t5":
        return None, (lambda score, b, h, q_idx, kv_idx: score + table[h, t5_bucket(kv_idx - q_idx)])
    raise ValueError(case)


def check_t5():
    """The score_mod's buckets against transformers' formula written out on a dense relative-position grid."""
    rel = torch.arange(-300, 301)
    expect = torch.where(rel > 0, 16, 0) + torch.where(
        rel.abs() < 8, rel.abs(),
        torch.clamp(8 + (torch.log(rel.abs().float() / 8) / math.log(128 / 8) * 8).to(torch.long), max=15))
    assert torch.equal(t5_bucket(rel), expect)
    assert int(t5_bucket(rel).max()) == 31 and int(t5_bucket(rel).min()) == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--modes", nargs="+", choices=("eager", "compile"), default=["eager", "compile"])
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = ap.parse_args()
    n = args.n
    if n > MAX_N or n % 4:
        ap.error(f"--n must be a multiple of 4 and at most {MAX_N} (eager flex materialises (1, 8, n, n) scores)")

    # Compile mode must never fall back to eager silently when dynamo runs out of cache entries.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))
    table = torch.randn(HEADS, T5_BUCKETS, generator=g)
    check_t5()
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    for threads in args.threads:
        torch.set_num_threads(threads)
        for case in args.cases:
            mask_mod, score_mod = make_case(case, n, table)
            block_mask = None
            if mask_mod is not None:
                build = lambda: create_block_mask(mask_mod, 1, 1, n, n, device="cpu")
                log(f"block_mask {case} N:{n} threads:{threads}")
                lo, med = timed(build, args.repetitions)
                emit(f"flex/block_mask/{case}/N:{n}/threads:{threads}", {"min_ms": lo, "median_ms": med})
                block_mask = build()
            for mode in args.modes:
                suffix = f"{case}/N:{n}/mode:{mode}/threads:{threads}"
                if mode == "compile":
                    torch._dynamo.reset()  # fresh compile per case and threads value
                    fn = torch.compile(flex_attention, dynamic=False)
                else:
                    fn = flex_attention
                call = lambda a, b, c: fn(a, b, c, score_mod=score_mod, block_mask=block_mask)

                # forward
                log(f"forward {suffix}")
                with torch.no_grad():
                    try:
                        start = time.perf_counter()
                        call(q, k, v)  # warm-up: compiles in compile mode
                        log(f"  first call {(time.perf_counter() - start):.1f} s")
                        lo, med = timed(lambda: call(q, k, v), args.repetitions)
                        emit(f"flex/{suffix}", {"min_ms": lo, "median_ms": med})
                    except Exception as e:
                        traceback.print_exc(file=sys.stderr)
                        emit(f"flex/{suffix}", {"error": describe(e)})

                # backward (forward included)
                def step():
                    for t in (qg, kg, vg):
                        t.grad = None
                    with torch.enable_grad():
                        call(qg, kg, vg).sum().backward()

                log(f"backward {suffix}")
                try:
                    start = time.perf_counter()
                    step()  # the try, and the warm-up (compile) in compile mode
                    log(f"  first call {(time.perf_counter() - start):.1f} s")
                except Exception as e:
                    traceback.print_exc(file=sys.stderr)
                    emit(f"flex_backward/{suffix}", {"error": describe(e)})
                    continue
                lo, med = timed(step, args.repetitions)
                emit(f"flex_backward/{suffix}", {"min_ms": lo, "median_ms": med})


if __name__ == "__main__":
    main()
