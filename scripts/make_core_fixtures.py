#!/usr/bin/env python3
"""Writes the fixtures of the functional core and of today's decoder options (tests/fixtures/core/*.sdpafix):
float64 PyTorch autograd through a plain definition of sdpa::attention's semantics (grouped-query heads,
rotary embeddings in both layouts and partial, scale, softcap, sinks, with masks, weights, bias, ALiBi,
causal, windows and key lengths), for sdpa::attention itself and for the module with kv_heads and a rotary.

Run with a Python that has PyTorch and numpy (a virtual environment with `pip install torch numpy`, or
Debian 13's python3-torch in the ../shared/peers/ root): python3 scripts/make_core_fixtures.py. Deterministic:
each case draws from its own seed and re-running rewrites byte-identical files (SHA-256 printed).

The format is make_fixtures.py's SDPAFIX1. Every file has `kind` (0: sdpa::attention, 1: the module),
`scalar_bits` 64 (the expected values are float64; the float tests run the same inputs rounded to float)
and the options:
    causal, window_left, window_right, masked_rows   i64 scalars
    key_lengths (b) i64, alibi_slopes (h), sinks (h)  f64: optional
    scale, softcap                                    f64 scalars (0: default / none)
    rotary.dim, rotary.interleaved i64; rotary.inv_freq (dim/2), rotary.attention_factor f64: optional
    attention_mask bool, attention_weights, attention_bias f64 (b|1, h|1, nq|1, nk|1): optional
kind 0: q (b, h, nq, d_k), k (b, kv, nk, d_k), v (b, kv, nk, d_v); grad_output (b, h, nq, d_v);
    output, probabilities (b, h, nq, nk); grad.q, grad.k, grad.v, grad.sinks, grad.attention_weights,
    grad.attention_bias (the last three when given).
kind 1: d_model, d_k, d_v, h, kv_heads i64; fc_*.weight / fc_*.bias (fc_k and fc_v with kv * d rows);
    queries (b, nq, d_model), keys, values (b, nk, d_model), self_attention i64; grad_output; output;
    grad.queries, grad.keys, grad.values, grad.fc_*.weight / bias, grad.sinks.
"""

import hashlib
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (the SDPAFIX1 writer, the hiding rules, ALiBi's slopes)

torch.set_num_threads(1)
DT = torch.float64


def rope(x, positions, dim, interleaved, inv_freq, factor):
    """Rotates the first `dim` features of x (..., n, d) at `positions` (n,): the pairs (m, m + dim/2), or
    (2m, 2m + 1) when interleaved, by position * inv_freq[m], cos and sin times factor."""
    if dim == 0:
        return x
    angle = positions.view(-1, 1).to(DT) * torch.tensor(inv_freq, dtype=DT).view(1, -1)  # (n, dim/2)
    c, s = torch.cos(angle) * factor, torch.sin(angle) * factor
    rot, rest = x[..., :dim], x[..., dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        ra, rb = a * c - b * s, b * c + a * s
        out = torch.stack([ra, rb], dim=-1).flatten(-2)
    else:
        half = dim // 2
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([out, rest], dim=-1)


def hidden_keys(case, b, nq, nk):
    """(b, 1, nq, nk) bool: causal, windows and key lengths, with q' = q + nk - nq."""
    pos = torch.arange(nq).view(nq, 1) + (nk - nq)
    key = torch.arange(nk).view(1, nk)
    hidden = torch.zeros(nq, nk, dtype=torch.bool)
    if case.get("causal"):
        hidden |= key > pos
    if case.get("window_left", -1) >= 0:
        hidden |= key < pos - case["window_left"]
    if case.get("window_right", -1) >= 0:
        hidden |= key > pos + case["window_right"]
    hidden = hidden.view(1, 1, nq, nk).expand(b, 1, nq, nk).clone()
    if case.get("key_lengths") is not None:
        for i, length in enumerate(case["key_lengths"]):
            hidden[i, :, :, length:] = True
    return hidden


def attention(case, q, k, v, weights, bias, mask, sinks):
    """sdpa::attention's definition (options.hpp) in torch ops. Returns (output, probabilities)."""
    b, h, nq, d_k = q.shape
    kv, nk = k.shape[1], k.shape[2]
    rot = case.get("rotary")
    if rot is not None:
        q = rope(q, torch.arange(nq) + (nk - nq), rot["dim"], rot["interleaved"], rot["inv_freq"], rot["factor"])
        k = rope(k, torch.arange(nk), rot["dim"], rot["interleaved"], rot["inv_freq"], rot["factor"])
    group = h // kv
    k = k.repeat_interleave(group, dim=1)  # Hugging Face's repeat_kv
    v = v.repeat_interleave(group, dim=1)
    scale = case.get("scale") or 1.0 / np.sqrt(d_k)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if weights is not None:
        s = s * weights
    cap = case.get("softcap") or 0.0
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias
    if case.get("alibi") is not None:
        pos = torch.arange(nq, dtype=DT).view(nq, 1) + (nk - nq)
        dist = (pos - torch.arange(nk, dtype=DT).view(1, nk)).abs()
        s = s - torch.tensor(case["alibi"], dtype=DT).view(1, h, 1, 1) * dist
    hidden = hidden_keys(case, b, nq, nk)
    if mask is not None:
        hidden = hidden | mask
    hidden = torch.broadcast_to(hidden, s.shape)
    s = s.masked_fill(hidden, -np.inf)
    if sinks is not None:
        full = torch.cat([s, sinks.view(1, h, 1, 1).expand(b, h, nq, 1)], dim=-1)
        p = torch.softmax(full, -1)[..., :nk]
    else:
        p = torch.softmax(s, -1)
        fully = hidden.all(-1, keepdim=True)
        if case.get("masked_rows", 0) == 0:
            p = torch.where(fully, torch.zeros_like(p), p)
    return torch.matmul(p, v), p


def options_entries(case, b, h, nq, nk):
    e = [("causal", np.int64(1 if case.get("causal") else 0)),
         ("window_left", np.int64(case.get("window_left", -1))),
         ("window_right", np.int64(case.get("window_right", -1))),
         ("masked_rows", np.int64(case.get("masked_rows", 0))),
         ("scale", np.float64(case.get("scale") or 0.0)),
         ("softcap", np.float64(case.get("softcap") or 0.0)),
         ("scalar_bits", np.int64(64))]
    if case.get("key_lengths") is not None:
        e.append(("key_lengths", np.array(case["key_lengths"], dtype=np.int64)))
    if case.get("alibi") is not None:
        e.append(("alibi_slopes", np.array(case["alibi"], dtype=np.float64)))
    rot = case.get("rotary")
    if rot is not None:
        e += [("rotary.dim", np.int64(rot["dim"])), ("rotary.interleaved", np.int64(1 if rot["interleaved"] else 0)),
              ("rotary.inv_freq", np.array(rot["inv_freq"], dtype=np.float64)),
              ("rotary.attention_factor", np.float64(rot["factor"]))]
    return e


def rotary(dim, interleaved=False, theta=10000.0, factor=1.0, scale_freq=1.0):
    inv = [scale_freq / theta ** (2 * m / dim) for m in range(dim // 2)]
    return {"dim": dim, "interleaved": interleaved, "inv_freq": inv, "factor": factor}


def optional_tensors(case, rng, b, h, nq, nk):
    out = {}
    if case.get("mask"):
        out["attention_mask"] = mf.random_mask(rng, mf.broadcast_shape(case["mask"], (b, h, nq, nk)), 0.25, False)
    if case.get("weights"):
        out["attention_weights"] = rng.uniform(0.5, 1.5, mf.broadcast_shape(case["weights"], (b, h, nq, nk)))
    if case.get("bias"):
        out["attention_bias"] = rng.normal(0, 1.0, mf.broadcast_shape(case["bias"], (b, h, nq, nk)))
    if case.get("sinks"):
        out["sinks"] = rng.normal(0, 1.0, (h,))
    return out


def attention_case(name, case):
    rng = np.random.default_rng(mf.seed_of("core/" + name))
    b, h, kv, nq, nk, d_k, d_v = (case[x] for x in ("b", "h", "kv", "nq", "nk", "d_k", "d_v"))
    # Float32-representable inputs, so that the float tests read the very values the reference used.
    f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
    q = f32(rng.normal(0, 1.0, (b, h, nq, d_k)))
    k = f32(rng.normal(0, 1.0, (b, kv, nk, d_k)))
    v = f32(rng.normal(0, 1.0, (b, kv, nk, d_v)))
    extra = {n: (a if a.dtype == np.bool_ else f32(a)) for n, a in optional_tensors(case, rng, b, h, nq, nk).items()}
    grad_out = f32(rng.normal(0, 1.0, (b, h, nq, d_v)))
    tq, tk, tv = (torch.tensor(a, dtype=DT, requires_grad=True) for a in (q, k, v))
    tw = torch.tensor(extra["attention_weights"], dtype=DT, requires_grad=True) if "attention_weights" in extra else None
    tb = torch.tensor(extra["attention_bias"], dtype=DT, requires_grad=True) if "attention_bias" in extra else None
    ts = torch.tensor(extra["sinks"], dtype=DT, requires_grad=True) if "sinks" in extra else None
    tm = torch.tensor(extra["attention_mask"]) if "attention_mask" in extra else None
    out, p = attention(case, tq, tk, tv, tw, tb, tm, ts)
    (out * torch.tensor(grad_out, dtype=DT)).sum().backward()
    entries = [("kind", np.int64(0)), ("q", q), ("k", k), ("v", v), ("grad_output", grad_out)]
    entries += options_entries(case, b, h, nq, nk)
    entries += [(n, a) for n, a in extra.items()]
    entries += [("output", out.detach().numpy()), ("probabilities", p.detach().numpy()),
                ("grad.q", tq.grad.numpy()), ("grad.k", tk.grad.numpy()), ("grad.v", tv.grad.numpy())]
    if tw is not None:
        entries.append(("grad.attention_weights", tw.grad.numpy()))
    if tb is not None:
        entries.append(("grad.attention_bias", tb.grad.numpy()))
    if ts is not None:
        entries.append(("grad.sinks", ts.grad.numpy()))
    return entries


def module_case(name, case):
    """The module: fc_q (h * d_k), fc_k (kv * d_k), fc_v (kv * d_v), heads split, the core, fc_o."""
    rng = np.random.default_rng(mf.seed_of("core-module/" + name))
    b, h, kv, nq, nk, d_model, d_k, d_v = (case[x] for x in ("b", "h", "kv", "nq", "nk", "d_model", "d_k", "d_v"))
    f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
    shapes = {"fc_q": (h * d_k, d_model), "fc_k": (kv * d_k, d_model), "fc_v": (kv * d_v, d_model),
              "fc_o": (d_model, h * d_v)}
    params = {}
    for layer, shape in shapes.items():
        params[layer + ".weight"] = f32(rng.normal(0, 0.5, shape))
        params[layer + ".bias"] = f32(rng.normal(0, 0.1, (shape[0],)))
    self_attention = case.get("self_attention", False)
    x = f32(rng.normal(0, 1.0, (b, nq, d_model)))
    xk = x if self_attention else f32(rng.normal(0, 1.0, (b, nk, d_model)))
    xv = x if self_attention else f32(rng.normal(0, 1.0, (b, nk, d_model)))
    extra = {n: (a if a.dtype == np.bool_ else f32(a)) for n, a in optional_tensors(case, rng, b, h, nq, nk).items()}
    grad_out = f32(rng.normal(0, 1.0, (b, nq, d_model)))
    tp = {n: torch.tensor(a, dtype=DT, requires_grad=True) for n, a in params.items()}
    tx = torch.tensor(x, dtype=DT, requires_grad=True)
    txk = tx if self_attention else torch.tensor(xk, dtype=DT, requires_grad=True)
    txv = tx if self_attention else torch.tensor(xv, dtype=DT, requires_grad=True)
    ts = torch.tensor(extra["sinks"], dtype=DT, requires_grad=True) if "sinks" in extra else None
    tm = torch.tensor(extra["attention_mask"]) if "attention_mask" in extra else None
    lin = lambda t, layer: t @ tp[layer + ".weight"].T + tp[layer + ".bias"]  # noqa: E731
    q = lin(tx, "fc_q").view(b, nq, h, d_k).permute(0, 2, 1, 3)
    k = lin(txk, "fc_k").view(b, nk, kv, d_k).permute(0, 2, 1, 3)
    v = lin(txv, "fc_v").view(b, nk, kv, d_v).permute(0, 2, 1, 3)
    att, _ = attention(case, q, k, v, None, None, tm, ts)
    out = lin(att.permute(0, 2, 1, 3).reshape(b, nq, h * d_v), "fc_o")
    (out * torch.tensor(grad_out, dtype=DT)).sum().backward()
    entries = [("kind", np.int64(1)), ("d_model", np.int64(d_model)), ("d_k", np.int64(d_k)), ("d_v", np.int64(d_v)),
               ("h", np.int64(h)), ("kv_heads", np.int64(kv)), ("self_attention", np.int64(1 if self_attention else 0))]
    entries += options_entries(case, b, h, nq, nk)
    entries += [(n, a) for n, a in params.items()]
    entries += [("queries", x), ("keys", xk), ("values", xv), ("grad_output", grad_out)]
    entries += [(n, a) for n, a in extra.items()]
    entries += [("output", out.detach().numpy())]
    if self_attention:
        entries += [("grad.queries", tx.grad.numpy())]
    else:
        entries += [("grad.queries", tx.grad.numpy()), ("grad.keys", txk.grad.numpy()), ("grad.values", txv.grad.numpy())]
    entries += [("grad." + n, t.grad.numpy()) for n, t in tp.items()]
    if ts is not None:
        entries.append(("grad.sinks", ts.grad.numpy()))
    return entries


ATTENTION_CASES = {
    "gqa_plain": dict(b=2, h=4, kv=2, nq=5, nk=7, d_k=8, d_v=6),
    "mqa_causal_square": dict(b=1, h=4, kv=1, nq=6, nk=6, d_k=8, d_v=8, causal=True),
    "gqa_rotary_half": dict(b=2, h=4, kv=2, nq=5, nk=5, d_k=8, d_v=6, causal=True, rotary=rotary(8)),
    "gqa_rotary_interleaved": dict(b=1, h=6, kv=3, nq=4, nk=9, d_k=8, d_v=4, causal=True, rotary=rotary(8, True)),
    "rotary_partial": dict(b=2, h=2, kv=2, nq=5, nk=5, d_k=10, d_v=5, causal=True, rotary=rotary(4, False, 500.0)),
    "rotary_scaled": dict(b=1, h=4, kv=2, nq=4, nk=8, d_k=8, d_v=8, rotary=rotary(8, False, 10000.0, 1.2, 0.25)),
    "scale": dict(b=2, h=2, kv=2, nq=3, nk=6, d_k=8, d_v=8, scale=0.3),
    "softcap": dict(b=2, h=4, kv=2, nq=5, nk=6, d_k=8, d_v=6, softcap=2.0, scale=1.0),
    "softcap_weights_bias": dict(b=2, h=2, kv=1, nq=4, nk=6, d_k=8, d_v=4, softcap=1.5, scale=0.9,
                                 weights="1hqk", bias="b11k"),
    "sinks": dict(b=2, h=4, kv=2, nq=4, nk=6, d_k=8, d_v=6, sinks=True),
    "sinks_fully_masked": dict(b=2, h=2, kv=2, nq=6, nk=3, d_k=4, d_v=4, causal=True, sinks=True, masked_rows=1),
    "sinks_window_mask": dict(b=1, h=4, kv=4, nq=7, nk=7, d_k=8, d_v=8, causal=True, window_left=2, sinks=True,
                              mask="11qk"),
    "windows_gqa_rotary_softcap": dict(b=2, h=4, kv=2, nq=6, nk=9, d_k=8, d_v=8, causal=True, window_left=3,
                                       softcap=3.0, rotary=rotary(8)),
    "everything": dict(b=3, h=4, kv=2, nq=5, nk=8, d_k=8, d_v=6, causal=True, window_left=4, key_lengths=[8, 6, 2],
                       alibi=mf.get_slopes(4), softcap=4.0, scale=0.5, sinks=True, rotary=rotary(6, True),
                       weights="1h1k", bias="1hqk", mask="b1qk"),
}

MODULE_CASES = {
    "module_gqa_rotary_self": dict(b=2, h=4, kv=2, nq=6, nk=6, d_model=12, d_k=4, d_v=5, causal=True,
                                   self_attention=True, rotary=rotary(4)),
    "module_mqa_cross_softcap_sinks": dict(b=2, h=4, kv=1, nq=3, nk=7, d_model=10, d_k=6, d_v=4, softcap=2.5,
                                           sinks=True, rotary=rotary(6, True)),
    "module_gqa_window_scale": dict(b=1, h=6, kv=3, nq=8, nk=8, d_model=12, d_k=4, d_v=4, causal=True, window_left=3,
                                    scale=0.7, self_attention=True),
}


def main():
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "core")
    os.makedirs(out_dir, exist_ok=True)
    for name, case in ATTENTION_CASES.items():
        write(out_dir, name, attention_case(name, case))
    for name, case in MODULE_CASES.items():
        write(out_dir, name, module_case(name, case))


def write(out_dir, name, entries):
    data = mf.encode_file(entries)
    path = os.path.join(out_dir, name + ".sdpafix")
    with open(path, "wb") as f:
        f.write(data)
    print(f"{hashlib.sha256(data).hexdigest()[:16]}  {os.path.relpath(path)}  ({len(data)} bytes)")


if __name__ == "__main__":
    main()
