#!/usr/bin/env python3
"""Writes tests/fixtures/bf16_accuracy.txt: how far PyTorch's own bfloat16 scaled_dot_product_attention is
from a float64 reference on the inputs tests/compute_test.cpp builds, so that the test can check that
sdpa's Compute::kBf16 is no further (issue 49's accuracy bound).

Run in a virtual environment with `pip install torch numpy`: python3 scripts/make_bf16_fixtures.py.

The inputs are made the same way here and in the test, without transcendental functions, so that both get
the same bits: element i of tensor t (0 q, 1 k, 2 v) of a case with seed s is x = 2 u - 1 with u the top 24
bits of splitmix64(splitmix64(4 s + t) + i) over 2^24, times 4 for q and k in a peaked case (scores with a
standard deviation near 5: a few large logits per row), rounded to bfloat16 (to nearest, ties to even).
Shape (batch 1, heads 1, n, d), scale 1 / sqrt(d). The reference is PyTorch's math SDPA in float64 on
those bfloat16 values; PyTorch's bf16 call gets them as bfloat16 tensors and returns bfloat16.
The errors are taken over the rows i with i % stride == stride - 1, stride = n / 512 (the last row among
them), so that the test's float64 reference needs 512 rows only. Each line: name n d causal peaked seed
max_abs_error rms_error (PyTorch's bf16 output on those rows against the reference).

tests/fixtures/bf16_gradients.txt: the same for the gradients of every case, with dO made as tensor 3
(not scaled): PyTorch's bf16 autograd against float64 autograd, over the same rows (of q for dq, of k and v
for dk and dv). Each line: name n d causal peaked seed, then max and rms error of dq, dk and dv.
"""

import os

import numpy as np
import torch
import torch.nn.functional as F

MASK = (1 << 64) - 1


def splitmix64(x):
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(MASK)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(MASK)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(MASK)
    return x ^ (x >> np.uint64(31))


def tensor(seed, which, n, d, peaked):
    with np.errstate(over="ignore"):
        base = splitmix64(np.uint64(4 * seed + which))
        h = splitmix64(base + np.arange(n * d, dtype=np.uint64))
    u = (h >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    x = 2.0 * u - 1.0
    if peaked and which < 2:
        x *= 4.0
    t = torch.from_numpy(x.astype(np.float32)).reshape(1, 1, n, d)
    return t.to(torch.bfloat16)


def cases():
    seed = 1
    for n in (1024, 4096):
        for d in (64, 128):
            for causal in (False, True):
                for peaked in (False, True):
                    name = f"n{n}_d{d}_{'causal' if causal else 'full'}_{'peaked' if peaked else 'random'}"
                    yield name, n, d, causal, peaked, seed
                    seed += 1


def main():
    torch.manual_seed(0)
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "bf16_accuracy.txt")
    lines = [f"# written by scripts/make_bf16_fixtures.py with torch {torch.__version__}",
             "# name n d causal peaked seed torch_bf16_max_abs_error torch_bf16_rms_error"]
    for name, n, d, causal, peaked, seed in cases():
        q, k, v = (tensor(seed, t, n, d, peaked) for t in range(3))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal).double()
        stride = n // 512
        err = (out - ref)[:, :, stride - 1::stride, :].abs()
        lines.append(f"{name} {n} {d} {int(causal)} {int(peaked)} {seed} {err.max().item():.9e} "
                     f"{err.pow(2).mean().sqrt().item():.9e}")
        print(lines[-1], flush=True)
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    grad_lines = [f"# written by scripts/make_bf16_fixtures.py with torch {torch.__version__}",
                  "# name n d causal peaked seed dq_max dq_rms dk_max dk_rms dv_max dv_rms (torch bf16 vs float64)"]
    for name, n, d, causal, peaked, seed in cases():
        q, k, v, do = (tensor(seed, t, n, d, peaked) for t in range(4))
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*ref, is_causal=causal).backward(do.double())
        low = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*low, is_causal=causal).backward(do)
        stride = n // 512
        errors = []
        for r, b in zip(ref, low):
            err = (b.grad.double() - r.grad)[:, :, stride - 1::stride, :].abs()
            errors += [f"{err.max().item():.9e}", f"{err.pow(2).mean().sqrt().item():.9e}"]
        grad_lines.append(f"{name} {n} {d} {int(causal)} {int(peaked)} {seed} " + " ".join(errors))
        print(grad_lines[-1], flush=True)
    with open(out_path.replace("bf16_accuracy", "bf16_gradients"), "w") as f:
        f.write("\n".join(grad_lines) + "\n")


if __name__ == "__main__":
    main()
