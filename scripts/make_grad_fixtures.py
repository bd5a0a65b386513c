#!/usr/bin/env python3
"""Writes the gradient fixtures of sdpa's training tests (tests/fixtures/grad/*.sdpafix): PyTorch autograd
through External-Attention-pytorch's ScaledDotProductAttention extended with sdpa::AttentionOptions (the
same forward_with_options as scripts/make_fixtures.py: weights, bias, ALiBi, mask, causal, windows, key
lengths, the masked-row policy), in float64 and float32.

Run with a Python that has PyTorch (on Debian: /usr/bin/python3 scripts/make_grad_fixtures.py). The output is
deterministic. Each file holds what make_fixtures.py's files hold (parameters, inputs, options, output) and:

    grad_output (b, nq, d_model)       d loss / d output, the loss being sum(output * grad_output)
    grad.queries, grad.keys, grad.values             d loss / d each input (q = k = v: each role's part)
    grad.fc_q.weight ... grad.fc_o.bias              d loss / d each parameter
    grad.attention_weights, grad.attention_bias      when given, in their own (broadcast) shapes
"""

import copy
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

torch.set_num_threads(1)


def option_case(name, b=2, nq=5, nk=6, d_model=8, d_k=3, d_v=4, h=2, policy=0, self_attention=False, **kw):
    c = mf.Case(name, b=b, nq=nq, nk=nk, d_model=d_model, d_k=d_k, d_v=d_v, h=h, masked_rows=policy,
                self_attention=self_attention, seed="grad/" + name)
    for key, value in kw.items():
        setattr(c, key, value)
    c.options = True
    return c


def build_cases():
    cases = []
    cases.append(option_case("plain_self", nq=6, nk=6, self_attention=True))
    cases.append(option_case("cross_dk_ne_dv", nq=4, nk=7, d_model=10, d_k=5, d_v=3, h=3))
    c = option_case("mask_and_weights", nq=4, nk=6)
    c.mask = mf.random_mask(c.rng, (2, 1, 4, 6), 0.3, False)
    c.weights = mf.random_weights(c.rng, (1, 2, 4, 6))
    cases.append(c)
    c = option_case("bias_alibi_causal_more_keys", nq=3, nk=8, h=4, causal=True, alibi=mf.get_slopes(4))
    c.bias = c.rng.normal(0, 1.0, (1, 4, 3, 8))
    cases.append(c)
    c = option_case("bias_broadcast_b11k", nq=4, nk=5)
    c.bias = c.rng.normal(0, 1.0, (2, 1, 1, 5))
    cases.append(c)
    cases.append(option_case("causal_more_queries_zero", nq=7, nk=3, causal=True, policy=0))
    cases.append(option_case("causal_more_queries_nan", nq=7, nk=3, causal=True, policy=1))
    cases.append(option_case("windows", nq=6, nk=9, window_left=2, window_right=1))
    cases.append(option_case("key_lengths", b=3, nq=4, nk=6, key_lengths=[6, 0, 3]))
    cases.append(option_case("single_head", nq=5, nk=5, d_k=6, d_v=5, h=1, causal=True))
    c = option_case("all_options", b=3, nq=5, nk=8, h=4, causal=True, window_left=4, key_lengths=[8, 6, 2],
                    alibi=mf.get_slopes(4))
    c.mask = mf.random_mask(c.rng, (3, 1, 5, 8), 0.2, True)
    c.weights = mf.random_weights(c.rng, (1, 4, 5, 8))
    c.bias = c.rng.normal(0, 1.0, (3, 4, 1, 8))
    cases.append(c)
    return cases


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = os.path.join(root, "tests", "fixtures", "grad")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for case in build_cases():
        g_out = case.rng.normal(0, 1, (case.b, case.nq, case.d_model))
        for bits, dtype in ((32, torch.float32), (64, torch.float64)):
            m = mf.reference(case, dtype)
            params = {n: p.detach().double().numpy().copy() for n, p in m.named_parameters()}
            q = torch.tensor(np.asarray(case.queries), dtype=dtype, requires_grad=True)
            if case.self_attention:
                k = v = q
            else:
                k = torch.tensor(np.asarray(case.keys), dtype=dtype, requires_grad=True)
                v = torch.tensor(np.asarray(case.values), dtype=dtype, requires_grad=True)
            mask = None if case.mask is None else torch.from_numpy(case.mask)
            w = None if case.weights is None else torch.tensor(case.weights, dtype=dtype, requires_grad=True)
            bias = None
            if case.bias is not None:
                bias = torch.tensor(case.bias, dtype=dtype, requires_grad=True)
            # The slopes as the file's dtype holds them; a copy of the case carries them to the forward.
            alibi = None if case.alibi is None else [float(torch.tensor(a, dtype=dtype)) for a in case.alibi]
            fcase = copy.copy(case)
            fcase.alibi = alibi
            go = torch.tensor(g_out, dtype=dtype)
            if case.self_attention:
                # q = k = v is one tensor: each role's gradient is taken through a clone of its own.
                qs = [q.detach().clone().requires_grad_(True) for _ in range(3)]
                y = forward_with_bias(m, fcase, qs[0], qs[1], qs[2], mask, w, bias, case.masked_rows)
                (y * go).sum().backward()
                grads = {"grad.queries": qs[0].grad, "grad.keys": qs[1].grad, "grad.values": qs[2].grad}
            else:
                y = forward_with_bias(m, fcase, q, k, v, mask, w, bias, case.masked_rows)
                (y * go).sum().backward()
                grads = {"grad.queries": q.grad, "grad.keys": k.grad, "grad.values": v.grad}
            for n, p in m.named_parameters():
                grads["grad." + n] = p.grad
            if w is not None:
                grads["grad.attention_weights"] = w.grad
            if bias is not None:
                grads["grad.attention_bias"] = bias.grad
            entries = [
                ("d_model", np.int64(case.d_model)), ("d_k", np.int64(case.d_k)), ("d_v", np.int64(case.d_v)),
                ("h", np.int64(case.h)), ("masked_rows", np.int64(case.masked_rows)), ("scalar_bits", np.int64(bits)),
                ("self_attention", np.int64(1 if case.self_attention else 0)),
                ("causal", np.int64(1 if case.causal else 0)), ("window_left", np.int64(case.window_left)),
                ("window_right", np.int64(case.window_right)),
            ]
            entries += [(n, params[n]) for n in mf.PARAMS]
            entries += [("queries", q.detach().double().numpy()),
                        ("keys", k.detach().double().numpy()), ("values", v.detach().double().numpy())]
            if case.key_lengths is not None:
                entries.append(("key_lengths", np.array(case.key_lengths, dtype=np.int64)))
            if case.alibi is not None:
                entries.append(("alibi_slopes", np.array(alibi, dtype=np.float64)))
            if mask is not None:
                entries.append(("attention_mask", mask.numpy()))
            if w is not None:
                entries.append(("attention_weights", w.detach().double().numpy()))
            if bias is not None:
                entries.append(("attention_bias", bias.detach().double().numpy()))
            entries.append(("output", y.detach().double().numpy()))
            entries.append(("grad_output", go.double().numpy()))
            entries += [(n, t.detach().double().numpy()) for n, t in sorted(grads.items())]
            blob = mf.encode_file(entries)
            fname = f"{case.name}_f{bits}.sdpafix"
            with open(os.path.join(out_dir, fname), "wb") as f:
                f.write(blob)
            written.append(fname)
            nan = sum(int(torch.isnan(t).sum()) for t in grads.values())
            print(f"{fname:40s} {len(blob):7d} B  NaN gradients: {nan}")
    stale = sorted(set(f for f in os.listdir(out_dir) if f.endswith(".sdpafix")) - set(written))
    for f in stale:
        os.remove(os.path.join(out_dir, f))
    return 0


def forward_with_bias(m, case, q, k, v, mask, w, bias, policy):
    """forward_with_options plus an additive bias tensor that autograd tracks."""
    b_s, nq = q.shape[:2]
    nk = k.shape[1]
    dtype = q.dtype
    qh = m.fc_q(q).view(b_s, nq, m.h, m.d_k).permute(0, 2, 1, 3)
    kh = m.fc_k(k).view(b_s, nk, m.h, m.d_k).permute(0, 2, 3, 1)
    vh = m.fc_v(v).view(b_s, nk, m.h, m.d_v).permute(0, 2, 1, 3)
    att = torch.matmul(qh, kh) / np.sqrt(m.d_k)
    if w is not None:
        att = att * w
    if bias is not None:
        att = att + bias
    if case.alibi is not None:
        pos = torch.arange(nq, dtype=dtype).view(nq, 1) + (nk - nq)
        dist = (pos - torch.arange(nk, dtype=dtype).view(1, nk)).abs()
        att = att - torch.tensor(case.alibi, dtype=dtype).view(1, m.h, 1, 1) * dist
    hidden = mf.hidden_by_options(case, None)
    if mask is not None:
        hidden = hidden | mask
    hidden = torch.broadcast_to(hidden, att.shape)
    att = att.masked_fill(hidden, -np.inf)
    att = torch.softmax(att, -1)
    if policy == 0:
        att = torch.where(hidden.all(-1, keepdim=True), torch.zeros_like(att), att)
    out = torch.matmul(att, vh).permute(0, 2, 1, 3).contiguous().view(b_s, nq, m.h * m.d_v)
    return m.fc_o(out)


if __name__ == "__main__":
    sys.exit(main())
