#!/usr/bin/env python3
"""PyTorch's side of bench/compute_bench.cpp: F.scaled_dot_product_attention on (1, 8, 4096, 64) tensors,
causal and not, in float32 and bfloat16, and the demo module written as PyTorch would run it in bfloat16
(nn.Linear q/k/v/o with bfloat16 weights and inputs, heads split, SDPA, merged) and in float32, on the
(50, 49, 512) demo, h 8, d_k 64, and autograd's backward of the SDPA (its forward included: PyTorch keeps
no state to start from). Eval, no grad, torch.set_num_threads(T). One JSON line per case:
    {"name": "attention/N:4096/causal:0/dtype:bf16/threads:1", "min_ms": ..., "median_ms": ..., "torch": "..."}

    python3 bench/peers/compute_peer.py [--threads 1 2] [--repetitions 10]
"""

import argparse
import json

import torch
import torch.nn.functional as F

from peerlib import timed

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


class Module(torch.nn.Module):
    def __init__(self, d_model=512, heads=8, d=64):
        super().__init__()
        self.h, self.d = heads, d
        self.fc_q = torch.nn.Linear(d_model, heads * d)
        self.fc_k = torch.nn.Linear(d_model, heads * d)
        self.fc_v = torch.nn.Linear(d_model, heads * d)
        self.fc_o = torch.nn.Linear(heads * d, d_model)

    def forward(self, x):
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, self.h, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(split(self.fc_q(x)), split(self.fc_k(x)), split(self.fc_v(x)))
        return self.fc_o(o.transpose(1, 2).reshape(b, n, self.h * self.d))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repetitions", type=int, default=10)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    qkv = [torch.rand(1, 8, 4096, 64, generator=g) * 2 - 1 for _ in range(3)]
    x = torch.randn(50, 49, 512, generator=g)
    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for dtype_name, dtype in DTYPES.items():
                q, k, v = (t.to(dtype) for t in qkv)
                for causal in (0, 1):
                    lo, med = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)),
                                    args.repetitions)
                    print(json.dumps({"name": f"attention/N:4096/causal:{causal}/dtype:{dtype_name}/threads:{threads}",
                                      "min_ms": lo, "median_ms": med, "torch": torch.__version__}), flush=True)
                q, k, v = (t.to(dtype).requires_grad_() for t in qkv)
                d_out = torch.rand(1, 8, 4096, 64, generator=g).to(dtype)

                def backward():
                    with torch.enable_grad():
                        out = F.scaled_dot_product_attention(q, k, v)
                        torch.autograd.grad(out, (q, k, v), d_out)

                try:
                    lo, med = timed(backward, max(2, args.repetitions // 2))
                    print(json.dumps({"name": f"backward/N:4096/dtype:{dtype_name}/threads:{threads}", "min_ms": lo,
                                      "median_ms": med, "torch": torch.__version__}), flush=True)
                except RuntimeError as e:  # a build without a CPU backward for this dtype
                    print(json.dumps({"name": f"backward/N:4096/dtype:{dtype_name}/threads:{threads}",
                                      "error": str(e)[:200], "torch": torch.__version__}), flush=True)
                m = Module().eval().to(dtype)
                xd = x.to(dtype)
                lo, med = timed(lambda: m(xd), args.repetitions * 5)
                print(json.dumps({"name": f"demo/dtype:{dtype_name}/threads:{threads}", "min_ms": lo,
                                  "median_ms": med, "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
