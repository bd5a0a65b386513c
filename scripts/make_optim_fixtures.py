#!/usr/bin/env python3
"""Writes the PyTorch fixtures of sdpa's optimizer tests (tests/fixtures/optim/optim_*.sdpafix).

Run with a Python that has PyTorch (on Debian: /usr/bin/python3 scripts/make_optim_fixtures.py). Each case
runs one torch.optim optimizer (SGD with momentum, dampening, Nesterov and weight decay variants, Adam,
AdamW, with and without AMSGrad) for five steps over the eight parameters of a small
ScaledDotProductAttention (d_model 3, h 2, d_k 2, d_v 2: the names and shapes of its state_dict) with a
fixed sequence of gradients, once in float64 and once in float32 from the same values, and records the
parameters after every step. The output is deterministic: re-running rewrites byte-identical files (it
prints a SHA-256 of each). The files live in a subdirectory so that the parity test's list of
tests/fixtures/*.sdpafix does not see them.

The format is make_fixtures.py's SDPAFIX1 (read by tests/support/fixture.hpp). Entries of every file:

    optimizer                     i64 scalar: 0 SGD, 1 Adam, 2 AdamW
    lr, momentum, dampening, weight_decay, beta1, beta2, eps
                                  f64 scalars, the hyperparameters as Python passed them
    nesterov, amsgrad             i64 scalars, 0 or 1
    steps                         i64 scalar, the number of steps (5)
    initial/<name>                f64, the parameter before the first step (float32 values)
    grad/<t>/<name>               f64, the gradient of step t = 0 .. steps-1 (float32 values)
    f64/<t>/<name>                f64, the parameter after step t in PyTorch's float64 run
    f32/<t>/<name>                f64, the same in its float32 run (float32 values)
"""

import hashlib
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import encode_file, seed_of  # noqa: E402  (the project's SDPAFIX1 writer)

torch.set_num_threads(1)

STEPS = 5
# The module's state_dict for d_model 3, h 2, d_k 2, d_v 2, in its order.
SHAPES = [("fc_q.weight", (4, 3)), ("fc_q.bias", (4,)), ("fc_k.weight", (4, 3)), ("fc_k.bias", (4,)),
          ("fc_v.weight", (4, 3)), ("fc_v.bias", (4,)), ("fc_o.weight", (3, 4)), ("fc_o.bias", (3,))]
SGD, ADAM, ADAMW = 0, 1, 2

# name, optimizer, keyword arguments as torch.optim takes them.
CASES = [
    ("sgd", SGD, dict(lr=0.1)),
    ("sgd_momentum", SGD, dict(lr=0.05, momentum=0.9)),
    ("sgd_momentum_dampening_weight_decay", SGD, dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("sgd_nesterov_weight_decay", SGD, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.05)),
    ("adam", ADAM, dict()),
    ("adam_weight_decay_amsgrad", ADAM, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True)),
    ("adamw", ADAMW, dict()),
    ("adamw_amsgrad", ADAMW, dict(lr=0.02, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05, amsgrad=True)),
]


def make_optimizer(kind, params, kwargs):
    if kind == SGD:
        return torch.optim.SGD(params, foreach=False, **kwargs)
    if kind == ADAM:
        return torch.optim.Adam(params, foreach=False, **kwargs)
    return torch.optim.AdamW(params, foreach=False, **kwargs)


def inputs(name):
    """Initial parameters and gradients, as float32 values (exact in float64 too)."""
    rng = np.random.RandomState(seed_of(name))
    initial = {n: rng.normal(0.0, 0.5, shape).astype(np.float32) for n, shape in SHAPES}
    grads = []
    for t in range(STEPS):
        # Gradients of varying size and sign across steps (so that AMSGrad's maximum matters), one zero
        # element and one step of all-zero gradients for a bias.
        g = {n: (rng.normal(0.0, 1.0, shape) * (0.2 + t % 3)).astype(np.float32) for n, shape in SHAPES}
        g["fc_q.weight"][0, 0] = 0.0
        if t == 2:
            g["fc_o.bias"][:] = 0.0
        grads.append(g)
    return initial, grads


def run(kind, kwargs, initial, grads, dtype):
    params = [torch.nn.Parameter(torch.tensor(initial[n], dtype=dtype)) for n, _ in SHAPES]
    opt = make_optimizer(kind, params, kwargs)
    after = []
    for t in range(STEPS):
        for p, (n, _) in zip(params, SHAPES):
            p.grad = torch.tensor(grads[t][n], dtype=dtype)
        opt.step()
        after.append({n: p.detach().clone().double().numpy() for p, (n, _) in zip(params, SHAPES)})
    return after


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = os.path.join(root, "tests", "fixtures", "optim")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, kind, kwargs in CASES:
        initial, grads = inputs(name)
        f64 = run(kind, kwargs, initial, grads, torch.float64)
        f32 = run(kind, kwargs, initial, grads, torch.float32)
        betas = kwargs.get("betas", (0.9, 0.999))
        default_decay = 1e-2 if kind == ADAMW else 0.0
        entries = [
            ("optimizer", np.int64(kind)),
            ("lr", np.float64(kwargs.get("lr", 1e-3))),
            ("momentum", np.float64(kwargs.get("momentum", 0.0))),
            ("dampening", np.float64(kwargs.get("dampening", 0.0))),
            ("weight_decay", np.float64(kwargs.get("weight_decay", default_decay))),
            ("beta1", np.float64(betas[0])),
            ("beta2", np.float64(betas[1])),
            ("eps", np.float64(kwargs.get("eps", 1e-8))),
            ("nesterov", np.int64(1 if kwargs.get("nesterov", False) else 0)),
            ("amsgrad", np.int64(1 if kwargs.get("amsgrad", False) else 0)),
            ("steps", np.int64(STEPS)),
        ]
        entries += [(f"initial/{n}", initial[n].astype(np.float64)) for n, _ in SHAPES]
        for t in range(STEPS):
            entries += [(f"grad/{t}/{n}", grads[t][n].astype(np.float64)) for n, _ in SHAPES]
        for t in range(STEPS):
            entries += [(f"f64/{t}/{n}", f64[t][n]) for n, _ in SHAPES]
            entries += [(f"f32/{t}/{n}", f32[t][n]) for n, _ in SHAPES]
        blob = encode_file(entries)
        fname = f"optim_{name}.sdpafix"
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(blob)
        written.append(fname)
        print(f"{fname:50s} {len(blob):6d} B  sha256={hashlib.sha256(blob).hexdigest()[:16]}")
    stale = sorted(set(f for f in os.listdir(out_dir) if f.endswith(".sdpafix")) - set(written))
    for f in stale:
        os.remove(os.path.join(out_dir, f))
        print(f"removed stale {f}")
    print(f"{len(written)} fixtures in {out_dir}")


if __name__ == "__main__":
    sys.exit(main())
