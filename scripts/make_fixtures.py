#!/usr/bin/env python3
"""Writes the PyTorch parity fixtures of sdpa's tests (tests/fixtures/*.sdpafix).

Run with a Python that has PyTorch (on Debian: /usr/bin/python3 scripts/make_fixtures.py). The output is
deterministic: every case draws from its own seeds, computations run on one CPU thread, and re-running
the script rewrites byte-identical files (it prints a SHA-256 of each).

The reference is External-Attention-pytorch's ScaledDotProductAttention, reproduced verbatim below, in
eval() mode. Its init (N(0, 0.001) weights, zero biases) makes the attention almost uniform, so every
case overwrites the parameters with N(0, 0.5^2) weights and N(0, 0.1^2) biases and draws the inputs
from N(0, 1): the softmax is far from uniform and masks, weights and the head order change the output.

File format "SDPAFIX1" (all integers and floats little-endian, no padding, no alignment):

    file   := magic  u32 count  entry*count          (the file ends right after the last entry)
    magic  := the 8 ASCII bytes "SDPAFIX1"
    entry  := u32 name_len  name  u8 dtype  u8 rank  i64 dims[rank]  data
    name   := name_len bytes of ASCII, no terminator; names are unique within a file
    dtype  := 0 f64 (IEEE-754 binary64) | 1 bool (u8, 0 or 1) | 2 i64
    data   := prod(dims) elements of dtype in row-major order (last index fastest); rank 0 is a scalar
              (one element)

Entries of every file (shapes as in PyTorch):

    d_model, d_k, d_v, h          i64 scalars, the constructor's arguments
    masked_rows                   i64 scalar, the sdpa::MaskedRows policy: 0 kZero, 1 kNaN
    scalar_bits                   i64 scalar, 32 (ScaledDotProductAttention<float>) or 64 (<double>)
    self_attention                i64 scalar, 1 when queries, keys and values are one tensor (the test
                                  then passes the same object three times), else 0
    fc_q.weight (h*d_k, d_model)  fc_q.bias (h*d_k)   fc_k.weight/bias likewise
    fc_v.weight (h*d_v, d_model)  fc_v.bias (h*d_v)   fc_o.weight (d_model, h*d_v)  fc_o.bias (d_model)
    queries (b, nq, d_model)      keys (b, nk, d_model)      values (b, nk, d_model)
    attention_mask    bool (b|1, h|1, nq|1, nk|1), optional, true = masked
    attention_weights f64  (b|1, h|1, nq|1, nk|1), optional
    output (b, nq, d_model)       the expected result; NaN where PyTorch gives NaN (kNaN policy)

Float data is stored as f64. In a 32-bit case every parameter and input is a float32 value (exactly
representable in f64) and `output` is PyTorch's float32 result widened to f64; in a 64-bit case
everything is float64. For the kNaN policy the expected output is the verbatim module's (PyTorch 1.13:
a query whose keys are all masked gets NaN, spread by fc_o to all d_model outputs). For kZero it is the
same forward with the probabilities of fully masked rows set to zero (what PyTorch >= 2.5's SDPA does),
so such a query's output is fc_o.bias. Cases without fully masked rows give the same output under
either policy (checked here).
"""

import copy
import hashlib
import math
import os
import struct
import sys
import zlib

import numpy as np
import torch
from torch import nn
from torch.nn import init

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------
# The reference, verbatim from External-Attention-pytorch (model/attention/SelfAttention.py).
class ScaledDotProductAttention(nn.Module):
    '''
    Scaled dot-product attention
    '''

    def __init__(self, d_model, d_k, d_v, h, dropout=.1):
        '''
        :param d_model: Output dimensionality of the model
        :param d_k: Dimensionality of queries and keys
        :param d_v: Dimensionality of values
        :param h: Number of heads
        '''
        super(ScaledDotProductAttention, self).__init__()
        self.fc_q = nn.Linear(d_model, h * d_k)
        self.fc_k = nn.Linear(d_model, h * d_k)
        self.fc_v = nn.Linear(d_model, h * d_v)
        self.fc_o = nn.Linear(h * d_v, d_model)
        self.dropout = nn.Dropout(dropout)

        self.d_model = d_model
        self.d_k = d_k
        self.d_v = d_v
        self.h = h

        self.init_weights()

    def init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                init.kaiming_normal_(m.weight, mode='fan_out')
                if m.bias is not None:
                    init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                init.constant_(m.weight, 1)
                init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                init.normal_(m.weight, std=0.001)
                if m.bias is not None:
                    init.constant_(m.bias, 0)

    def forward(self, queries, keys, values, attention_mask=None, attention_weights=None):
        '''
        Computes
        :param queries: Queries (b_s, nq, d_model)
        :param keys: Keys (b_s, nk, d_model)
        :param values: Values (b_s, nk, d_model)
        :param attention_mask: Mask over attention values (b_s, h, nq, nk). True indicates masking.
        :param attention_weights: Multiplicative weights for attention values (b_s, h, nq, nk).
        :return:
        '''
        b_s, nq = queries.shape[:2]
        nk = keys.shape[1]

        q = self.fc_q(queries).view(b_s, nq, self.h, self.d_k).permute(0, 2, 1, 3)  # (b_s, h, nq, d_k)
        k = self.fc_k(keys).view(b_s, nk, self.h, self.d_k).permute(0, 2, 3, 1)  # (b_s, h, d_k, nk)
        v = self.fc_v(values).view(b_s, nk, self.h, self.d_v).permute(0, 2, 1, 3)  # (b_s, h, nk, d_v)

        att = torch.matmul(q, k) / np.sqrt(self.d_k)  # (b_s, h, nq, nk)
        if attention_weights is not None:
            att = att * attention_weights
        if attention_mask is not None:
            att = att.masked_fill(attention_mask, -np.inf)
        att = torch.softmax(att, -1)
        att = self.dropout(att)

        out = torch.matmul(att, v).permute(0, 2, 1, 3).contiguous().view(b_s, nq, self.h * self.d_v)  # (b_s, nq, h*d_v)
        out = self.fc_o(out)  # (b_s, nq, d_model)
        return out


# The same forward, with the probabilities of fully masked rows set to zero (sdpa::MaskedRows::kZero,
# PyTorch >= 2.5's SDPA). Also returns the pre-softmax scores and the probabilities for the checks below.
def forward_zero_masked_rows(m, queries, keys, values, attention_mask=None, attention_weights=None):
    b_s, nq = queries.shape[:2]
    nk = keys.shape[1]
    q = m.fc_q(queries).view(b_s, nq, m.h, m.d_k).permute(0, 2, 1, 3)
    k = m.fc_k(keys).view(b_s, nk, m.h, m.d_k).permute(0, 2, 3, 1)
    v = m.fc_v(values).view(b_s, nk, m.h, m.d_v).permute(0, 2, 1, 3)
    att = torch.matmul(q, k) / np.sqrt(m.d_k)
    if attention_weights is not None:
        att = att * attention_weights
    scores = att
    if attention_mask is not None:
        att = att.masked_fill(attention_mask, -np.inf)
    att = torch.softmax(att, -1)
    if attention_mask is not None:
        fully = torch.broadcast_to(attention_mask, att.shape).all(-1, keepdim=True)
        att = torch.where(fully, torch.zeros_like(att), att)
    att = m.dropout(att)
    out = torch.matmul(att, v).permute(0, 2, 1, 3).contiguous().view(b_s, nq, m.h * m.d_v)
    return m.fc_o(out), scores, att


# The ALiBi paper's reference slopes, verbatim from ofirpress/attention_with_linear_biases
# (fairseq/models/transformer.py).
def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = (2**(-2**-(math.log2(n)-3)))
        ratio = start
        return [start*ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    else:
        closest_power_of_2 = 2**math.floor(math.log2(n))
        return get_slopes_power_of_2(closest_power_of_2) + get_slopes(2*closest_power_of_2)[0::2][:n-closest_power_of_2]


def hidden_by_options(case, dtype_device_shape):
    """The bool (b, 1, nq, nk) tensor of keys hidden by causal, the windows and the key lengths, with
    q' = q + (nk - nq) (lower-right alignment)."""
    b, nq, nk = case.b, case.nq, case.nk
    pos = torch.arange(nq).view(nq, 1) + (nk - nq)
    key = torch.arange(nk).view(1, nk)
    hidden = torch.zeros(b, 1, nq, nk, dtype=torch.bool)
    if case.causal:
        hidden |= (key > pos).view(1, 1, nq, nk)
    if case.window_left >= 0:
        hidden |= (key < pos - case.window_left).view(1, 1, nq, nk)
    if case.window_right >= 0:
        hidden |= (key > pos + case.window_right).view(1, 1, nq, nk)
    if case.key_lengths is not None:
        lengths = torch.tensor(case.key_lengths).view(b, 1, 1, 1)
        hidden |= key.view(1, 1, 1, nk) >= lengths
    return hidden


def forward_with_options(m, case, queries, keys, values, attention_mask, attention_weights, policy):
    """sdpa::AttentionOptions' definition in torch ops on the reference module's projections: scores
    q k^T / sqrt(d_k), times the weights, plus the bias, minus slope[h] * |q' - k|, -inf where the mask or
    an option hides a key, softmax (a fully hidden row: NaN under kNaN, zeros under kZero), times v, fc_o.
    Returns (output, probabilities)."""
    b_s, nq = queries.shape[:2]
    nk = keys.shape[1]
    dtype = queries.dtype
    q = m.fc_q(queries).view(b_s, nq, m.h, m.d_k).permute(0, 2, 1, 3)
    k = m.fc_k(keys).view(b_s, nk, m.h, m.d_k).permute(0, 2, 3, 1)
    v = m.fc_v(values).view(b_s, nk, m.h, m.d_v).permute(0, 2, 1, 3)
    att = torch.matmul(q, k) / np.sqrt(m.d_k)
    if attention_weights is not None:
        att = att * attention_weights
    if case.bias is not None:
        att = att + torch.from_numpy(case.bias).to(dtype)
    if case.alibi is not None:
        pos = torch.arange(nq, dtype=dtype).view(nq, 1) + (nk - nq)
        dist = (pos - torch.arange(nk, dtype=dtype).view(1, nk)).abs()
        att = att - torch.tensor(case.alibi, dtype=dtype).view(1, m.h, 1, 1) * dist
    hidden = hidden_by_options(case, None)
    if attention_mask is not None:
        hidden = hidden | attention_mask
    hidden = torch.broadcast_to(hidden, att.shape)
    att = att.masked_fill(hidden, -np.inf)
    att = torch.softmax(att, -1)
    fully = hidden.all(-1, keepdim=True)
    if policy == 0:
        att = torch.where(fully, torch.zeros_like(att), att)
    out = torch.matmul(att, v).permute(0, 2, 1, 3).contiguous().view(b_s, nq, m.h * m.d_v)
    return m.fc_o(out), att


# ---------------------------------------------------------------------------------------------------
# Writing.
MAGIC = b"SDPAFIX1"
F64, BOOL, I64 = 0, 1, 2
PARAMS = ["fc_q.weight", "fc_q.bias", "fc_k.weight", "fc_k.bias",
          "fc_v.weight", "fc_v.bias", "fc_o.weight", "fc_o.bias"]


def encode_entry(name, array):
    array = np.asarray(array)
    if array.dtype == np.bool_:
        code, data = BOOL, array.astype(np.uint8)
    elif array.dtype.kind in "iu":
        code, data = I64, array.astype("<i8")
    elif array.dtype.kind == "f":
        code, data = F64, array.astype("<f8")
    else:
        raise TypeError(f"{name}: unsupported dtype {array.dtype}")
    raw = name.encode("ascii")
    head = struct.pack("<I", len(raw)) + raw + struct.pack("<BB", code, array.ndim)
    head += b"".join(struct.pack("<q", d) for d in array.shape)
    return head + np.ascontiguousarray(data).tobytes(order="C")


def encode_file(entries):
    names = [n for n, _ in entries]
    assert len(set(names)) == len(names), names
    return MAGIC + struct.pack("<I", len(entries)) + b"".join(encode_entry(n, a) for n, a in entries)


# ---------------------------------------------------------------------------------------------------
# Cases.
def seed_of(text):
    return zlib.crc32(text.encode("ascii"))


def broadcast_shape(form, full):
    """form: 4 characters, a letter for a full dimension and '1' for a broadcast one (e.g. '1h1k')."""
    return tuple(f if c != "1" else 1 for c, f in zip(form, full))


ALL_FORMS = ["".join(c if (bits >> (3 - i)) & 1 else "1" for i, c in enumerate("bhqk"))
             for bits in range(15, -1, -1)]  # bhqk, bhq1, bh1k, ..., 1111


def random_mask(rng, shape, p, allow_full_rows):
    mask = rng.random(shape) < p
    if not allow_full_rows:
        # Every row of the mask's own array keeps at least one visible key, hence so does every
        # row of the broadcast mask.
        rows = mask.reshape(-1, shape[-1])
        for row in rows:
            if row.all():
                row[rng.integers(shape[-1])] = False
        mask = rows.reshape(shape)
    elif mask.size > 1:
        flat = mask.reshape(-1)
        if flat.all():
            flat[rng.integers(flat.size)] = False
        if not flat.any():
            flat[rng.integers(flat.size)] = True
    return mask


def random_weights(rng, shape):
    w = rng.uniform(0.2, 2.0, shape)
    w[rng.random(shape) < 0.25] *= -1.0  # some negative weights
    return w


class Case:
    def __init__(self, name, b, nq, nk, d_model, d_k, d_v, h, masked_rows=0, self_attention=False,
                 query_scale=1.0, seed=None):
        self.name, self.b, self.nq, self.nk = name, b, nq, nk
        self.d_model, self.d_k, self.d_v, self.h = d_model, d_k, d_v, h
        self.masked_rows, self.self_attention, self.query_scale = masked_rows, self_attention, query_scale
        self.mask = None      # numpy bool array
        self.weights = None   # numpy float64 array
        self.expect_full_rows = False  # whether fully masked rows are intended
        self.large_logits = False
        self.nonfinite = False  # NaN or inf inputs: PyTorch's NaNs are the expectation
        # sdpa::AttentionOptions without tensors, and the additive bias: see forward_with_options.
        self.causal = False
        self.window_left = -1
        self.window_right = -1
        self.key_lengths = None   # list, one per batch entry
        self.alibi = None         # list, one slope per head
        self.bias = None          # numpy float64 array, each dim 1 or full
        rng = np.random.default_rng(seed_of(name if seed is None else seed))
        self.rng = rng
        nq_eff = nk if self_attention else nq
        self.params = {
            "fc_q.weight": rng.normal(0, 0.5, (h * d_k, d_model)), "fc_q.bias": rng.normal(0, 0.1, h * d_k),
            "fc_k.weight": rng.normal(0, 0.5, (h * d_k, d_model)), "fc_k.bias": rng.normal(0, 0.1, h * d_k),
            "fc_v.weight": rng.normal(0, 0.5, (h * d_v, d_model)), "fc_v.bias": rng.normal(0, 0.1, h * d_v),
            "fc_o.weight": rng.normal(0, 0.5, (d_model, h * d_v)), "fc_o.bias": rng.normal(0, 0.1, d_model),
        }
        self.queries = rng.normal(0, 1, (b, nq_eff, d_model)) * query_scale
        if self_attention:
            self.nq = nk
            self.keys = self.values = self.queries
        else:
            self.keys = rng.normal(0, 1, (b, nk, d_model))
            self.values = rng.normal(0, 1, (b, nk, d_model))

    @property
    def full(self):
        return (self.b, self.h, self.nq, self.nk)


def build_cases():
    cases = []

    # Self-attention: one tensor for q, k and v; d_k = d_v and h * d_k = d_model.
    cases.append(Case("self_attention", b=2, nq=6, nk=6, d_model=16, d_k=4, d_v=4, h=4, self_attention=True))

    # Cross-attention: nq != nk, d_k != d_v, h*d_k != d_model, h*d_v != d_model.
    cases.append(Case("cross_attention", b=2, nq=3, nk=7, d_model=12, d_k=5, d_v=6, h=3))

    # Every broadcast form of attention_mask. With the keys dimension full, no row is fully masked
    # (policy kZero, the default). With the keys dimension 1, a true element masks whole rows, so those
    # forms have fully masked rows by construction: kZero in the float32 file, kNaN in the float64 one
    # (the per-dtype policy is chosen in main()).
    for form in ALL_FORMS:
        c = Case(f"mask_{form}", b=2, nq=3, nk=5, d_model=8, d_k=3, d_v=2, h=2)
        full_rows = form[3] == "1"
        c.mask = random_mask(c.rng, broadcast_shape(form, c.full), 0.4 if not full_rows else 0.35, full_rows)
        if form == "1111":
            c.mask[...] = True  # a scalar mask: true, otherwise it would not be tested at all
        c.expect_full_rows = full_rows
        c.policy_by_dtype = full_rows
        cases.append(c)

    # Every broadcast form of attention_weights, U(0.2, 2) with about a quarter negated.
    for form in ALL_FORMS:
        c = Case(f"weights_{form}", b=2, nq=3, nk=5, d_model=8, d_k=3, d_v=2, h=2)
        c.weights = random_weights(c.rng, broadcast_shape(form, c.full))
        cases.append(c)

    # Mask and weights together; the weights are negative on some masked positions, so multiplying
    # after masking (-inf * negative = +inf) would be caught.
    c = Case("mask_and_weights", b=2, nq=4, nk=6, d_model=10, d_k=3, d_v=4, h=2)
    c.mask = random_mask(c.rng, (2, 1, 4, 6), 0.4, False)
    c.weights = random_weights(c.rng, (1, 2, 4, 6))
    c.weights[0, 0][c.mask[0, 0]] = -1.5
    cases.append(c)

    # Fully masked rows, under each policy.
    for policy, tag in ((1, "nan"), (0, "zero")):
        # Some rows fully masked through a (b, 1, nq, nk) mask.
        c = Case(f"fully_masked_rows_{tag}", b=3, nq=4, nk=5, d_model=8, d_k=2, d_v=3, h=2, masked_rows=policy)
        c.mask = random_mask(c.rng, (3, 1, 4, 5), 0.3, False)
        c.mask[0, 0, 1, :] = True
        c.mask[2, 0, 0, :] = True
        c.mask[2, 0, 3, :] = True
        c.expect_full_rows = True
        cases.append(c)
        # A key-padding mask (b, 1, 1, nk) that masks every key of batch element 1 (and some keys of
        # the others).
        c = Case(f"fully_masked_batch_{tag}", b=3, nq=3, nk=6, d_model=8, d_k=4, d_v=2, h=2, masked_rows=policy)
        lengths = [4, 0, 6]
        c.mask = np.array([[[[k >= n for k in range(6)]]] for n in lengths], dtype=bool)
        c.expect_full_rows = True
        cases.append(c)
        # A full (b, h, nq, nk) mask that masks a row in one head only: under kZero only that head's
        # slice of the attention output is zero, so the output is not just fc_o.bias.
        c = Case(f"fully_masked_head_{tag}", b=2, nq=3, nk=4, d_model=9, d_k=3, d_v=3, h=3, masked_rows=policy)
        c.mask = random_mask(c.rng, (2, 3, 3, 4), 0.3, False)
        c.mask[0, 1, 2, :] = True
        c.mask[1, 0, 0, :] = True
        c.mask[1, 2, 0, :] = True
        c.expect_full_rows = True
        cases.append(c)

    # Large logits: queries scaled so that the scores are around 1e4; exp overflows without the max
    # subtraction. A mask hides some keys, among them some rows' best key.
    # The first seed whose best and second-best visible scores are more than 50 apart in every row
    # (the softmax is then one-hot to float64 precision, so that float32 rounding of ~1e4 scores,
    # about 1e-3, cannot matter).
    for attempt in range(1000):
        c = Case("large_logits", b=2, nq=4, nk=6, d_model=8, d_k=4, d_v=3, h=2, query_scale=3000.0,
                 seed=f"large_logits/{attempt}")
        c.mask = random_mask(c.rng, (2, 1, 4, 6), 0.25, False)
        c.large_logits = True
        m = reference(c, torch.float64)
        with torch.no_grad():
            _, scores, _ = forward_zero_masked_rows(m, *(torch.from_numpy(a) for a in (c.queries, c.keys, c.values)),
                                                    torch.from_numpy(c.mask))
        top2 = scores.masked_fill(torch.from_numpy(c.mask), -np.inf).topk(2, -1).values
        if (top2[..., 0] - top2[..., 1]).min() > 50:
            break
    else:
        raise RuntimeError("large_logits: no well-separated seed")
    cases.append(c)

    # Edge cases.
    cases.append(Case("single_head", b=2, nq=4, nk=6, d_model=8, d_k=5, d_v=7, h=1))
    cases.append(Case("single_batch", b=1, nq=5, nk=9, d_model=12, d_k=4, d_v=3, h=3))
    cases.append(Case("single_query", b=1, nq=1, nk=7, d_model=8, d_k=4, d_v=4, h=2))
    cases.append(Case("single_key", b=2, nq=3, nk=1, d_model=8, d_k=3, d_v=5, h=2))
    c = Case("single_everything", b=1, nq=1, nk=1, d_model=8, d_k=8, d_v=8, h=1)
    cases.append(c)

    # sdpa::AttentionOptions without tensors (causal, windows, key lengths, ALiBi) and the additive bias.
    # Fully hidden rows (causal with nq > nk, a key length of 0) follow the policy of the file's dtype.
    def option_case(name, b=2, nq=6, nk=6, h=2, **kw):
        c = Case(name, b=b, nq=nq, nk=nk, d_model=8, d_k=3, d_v=4, h=h)
        for key, value in kw.items():
            setattr(c, key, value)
        c.options = True
        c.policy_by_dtype = True
        return c
    cases.append(option_case("causal_square", causal=True))
    cases.append(option_case("causal_more_keys", nq=3, nk=8, causal=True))
    cases.append(option_case("causal_more_queries", nq=8, nk=3, causal=True))
    cases.append(option_case("window_left", nk=9, window_left=2))
    cases.append(option_case("window_right", nq=7, window_right=1))
    cases.append(option_case("window_both", nq=5, nk=9, window_left=2, window_right=1))
    cases.append(option_case("window_zero", window_left=0, window_right=0))
    cases.append(option_case("window_sliding_causal", nq=9, nk=9, causal=True, window_left=3))
    cases.append(option_case("key_lengths", b=3, nq=4, nk=7, key_lengths=[7, 0, 3]))
    for form in ("bhqk", "1hqk", "b11k", "11qk"):  # (a bias constant along keys changes nothing)
        c = option_case(f"bias_{form}", nq=4, nk=5)
        c.bias = c.rng.normal(0, 1.5, broadcast_shape(form, c.full))
        cases.append(c)
    cases.append(option_case("alibi", h=4, nq=6, nk=6, alibi=get_slopes(4)))
    cases.append(option_case("alibi_causal_more_keys", h=3, nq=4, nk=9, causal=True, alibi=get_slopes(3)))
    c = option_case("all_options", b=3, h=4, nq=5, nk=8, causal=True, window_left=4, key_lengths=[8, 6, 2],
                    alibi=get_slopes(4))
    c.mask = random_mask(c.rng, (3, 1, 5, 8), 0.2, True)
    c.weights = random_weights(c.rng, (1, 4, 5, 8))
    c.bias = c.rng.normal(0, 1.0, (3, 4, 1, 8))
    cases.append(c)

    # Non-finite inputs propagate as in PyTorch: a NaN in one query makes that query's output NaN (and only
    # that query's); an infinite key element makes scores +-inf, hence NaN rows; a NaN in the keys at a
    # position the mask hides reaches nothing (its score is replaced by -inf).
    c = Case("nonfinite_query_nan", b=2, nq=4, nk=5, d_model=8, d_k=4, d_v=3, h=2)
    c.queries[1, 2, 3] = np.nan
    c.nonfinite = True
    cases.append(c)
    c = Case("nonfinite_key_inf", b=2, nq=3, nk=5, d_model=8, d_k=4, d_v=3, h=2)
    c.keys[0, 1, 0] = np.inf
    c.nonfinite = True
    cases.append(c)
    c = Case("nonfinite_hidden_key_nan", b=2, nq=3, nk=6, d_model=8, d_k=4, d_v=3, h=2)
    c.keys[1, 4, 2] = np.nan
    c.mask = np.zeros((2, 1, 1, 6), dtype=bool)
    c.mask[1, 0, 0, 4] = True
    c.mask[0, 0, 0, 0] = True
    c.nonfinite = True
    cases.append(c)
    return cases


# ---------------------------------------------------------------------------------------------------
def reference(case, dtype):
    """The reference module in dtype, eval() mode, holding the case's parameters."""
    m = ScaledDotProductAttention(case.d_model, case.d_k, case.d_v, case.h).eval().to(dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.from_numpy(case.params[name]))  # rounds to float32 in a 32-bit case
    return m


def to_torch(array, dtype):
    return None if array is None else torch.from_numpy(np.asarray(array)).to(dtype)


def run(case, m, dtype, policy):
    q = to_torch(case.queries, dtype)
    k = q if case.self_attention else to_torch(case.keys, dtype)
    v = q if case.self_attention else to_torch(case.values, dtype)
    mask = None if case.mask is None else torch.from_numpy(case.mask)
    w = to_torch(case.weights, dtype)
    if getattr(case, "options", False):
        with torch.no_grad():
            y, att = forward_with_options(m, case, q, k, v, mask, w, policy)
        return y, y, y, None, att, (q, k, v, mask, w)
    with torch.no_grad():
        y_nan = m(q, k, v, mask, w)
        y_zero, scores, att = forward_zero_masked_rows(m, q, k, v, mask, w)
    return (y_nan if policy == 1 else y_zero), y_nan, y_zero, scores, att, (q, k, v, mask, w)


def check_options_case(case, y, att, inputs, m, policy):
    """An options case: the options visibly change the output; probabilities rows sum to 1 or are fully
    hidden; hidden keys are exactly 0."""
    name = case.name
    q, k, v, mask, w = inputs
    hidden = hidden_by_options(case, None)
    if mask is not None:
        hidden = hidden | mask
    hidden = torch.broadcast_to(hidden, att.shape)
    fully = hidden.all(-1)
    assert (att[hidden & ~fully.unsqueeze(-1)] == 0).all(), name
    sums = att.sum(-1)
    ok = ~fully
    assert torch.allclose(sums[ok], torch.ones_like(sums[ok])), name
    if policy == 1:
        assert torch.isnan(att[fully]).all(), name
    else:
        assert (att[fully] == 0).all(), name
    plain = m(q, k, v)
    y_ok = ~torch.isnan(y)
    diff = (y[y_ok] - plain[y_ok]).abs().max()
    assert diff > 1e-3 * plain.abs().max(), f"{name}: the options change the output by {diff}"
    return bool(fully.any())


def check_case(case, y, y_nan, y_zero, scores, att, inputs, m):
    name = case.name
    q, k, v, mask, w = inputs
    full_rows = False
    if mask is not None:
        full_rows = bool(torch.broadcast_to(mask, scores.shape).all(-1).any())
    assert full_rows == case.expect_full_rows, f"{name}: fully masked rows {full_rows}"
    if case.nonfinite:
        assert torch.equal(torch.isnan(y_nan), torch.isnan(y_zero)), name
        nan_rows = torch.isnan(y).any(-1)
        assert nan_rows.any() == (not name.startswith("nonfinite_hidden")), f"{name}: NaN rows {nan_rows}"
        assert not nan_rows.all(), f"{name}: every row NaN"
        return
    if not full_rows:
        assert torch.equal(y_nan, y_zero), f"{name}: policies differ without fully masked rows"
        assert not torch.isnan(y).any(), f"{name}: NaN without fully masked rows"
    else:
        fully_q = torch.broadcast_to(mask, scores.shape).all(-1).any(1)  # (b, nq): some head fully masked
        assert torch.equal(torch.isnan(y_nan).any(-1), fully_q), name
        assert torch.isnan(y_nan).any(-1).eq(torch.isnan(y_nan).all(-1)).all(), name
        assert not torch.isnan(y_zero).any(), name
    # The attention is far from uniform (unless there is a single key).
    if case.nk > 1 and not case.large_logits:
        peak = att.max(-1).values
        visible = peak > 0
        assert not visible.any() or peak[visible].mean() > 1.5 / case.nk, f"{name}: attention nearly uniform"
    if case.large_logits:
        finite = scores.masked_fill(mask, -np.inf)
        top2 = finite.topk(2, -1).values
        assert scores.abs().max() > 5e3, f"{name}: scores not large: {scores.abs().max()}"
        assert (top2[..., 0] - top2[..., 1]).min() > 50, f"{name}: near tie among large logits"
    # Mask and weights visibly change the output.
    with torch.no_grad():
        if mask is not None or w is not None:
            plain = m(q, k, v)
            # (Under kNaN the non-NaN rows of a mask with fully masked rows may equal the unmasked
            # output; the kZero output shows the effect in any case.)
            diff = (y_zero - plain).abs().max()
            assert diff > 1e-2 * plain.abs().max(), f"{name}: mask/weights change output by {diff}"
        if case.h > 1:
            # Reversing the heads of fc_v (which head's values meet which columns of fc_o) changes
            # the output, and so does reversing the heads of fc_q alone (which queries meet which
            # keys) when there is more than one key.
            def reversed_heads(d):
                return torch.arange(case.h * d).view(case.h, d).flip(0).reshape(-1)
            for layer_name, d in (("fc_v", case.d_v), ("fc_q", case.d_k)):
                if layer_name == "fc_q" and case.nk == 1:
                    continue
                m2 = ScaledDotProductAttention(case.d_model, case.d_k, case.d_v, case.h).eval().to(y.dtype)
                m2.load_state_dict(m.state_dict())
                perm = reversed_heads(d)
                getattr(m2, layer_name).weight.copy_(getattr(m, layer_name).weight[perm])
                getattr(m2, layer_name).bias.copy_(getattr(m, layer_name).bias[perm])
                y2 = m2(q, k, v)
                diff = (y2 - m(q, k, v)).abs().max()
                assert diff > 1e-2 * y2.abs().max(), f"{name}: {layer_name} head order does not matter ({diff})"


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = os.path.join(root, "tests", "fixtures")
    os.makedirs(out_dir, exist_ok=True)
    total = 0
    written = []
    for case in build_cases():
        y64_of_f32 = None
        for bits, dtype in ((32, torch.float32), (64, torch.float64)):
            policy = case.masked_rows
            if getattr(case, "policy_by_dtype", False):
                policy = 0 if bits == 32 else 1
            m = reference(case, dtype)
            if bits == 32:
                # Round the case's parameters and inputs to float32 so that the 32-bit file holds the
                # float32 values PyTorch computed with.
                params = {n: p.detach().numpy().astype(np.float64) for n, p in m.named_parameters()}
            else:
                params = {n: p.detach().numpy() for n, p in m.named_parameters()}
            y, y_nan, y_zero, scores, att, inputs = run(case, m, dtype, policy)
            if getattr(case, "options", False):
                with torch.no_grad():
                    check_options_case(case, y, att, inputs, m, policy)
            else:
                check_case(case, y, y_nan, y_zero, scores, att, inputs, m)
            q, k, v, mask, w = inputs
            cond = ""
            if bits == 32:
                # Conditioning: the float32 result must agree with a float64 evaluation of the same
                # float32 values well inside the C++ test's tolerance (2e-5).
                m64 = reference(case, torch.float64)
                with torch.no_grad():
                    for n, p in m64.named_parameters():
                        p.copy_(torch.from_numpy(params[n]))
                (y_ref64, *_rest) = run_with(case, m64, torch.float64, policy, q, k, v, mask, w)
                ok = ~torch.isnan(y_ref64)
                assert torch.equal(ok, ~torch.isnan(y)), case.name
                scale = max(y_ref64[ok].abs().max().item(), 1e-300) if ok.any() else 1.0
                err = (y.double()[ok] - y_ref64[ok]).abs().max().item() / scale if ok.any() else 0.0
                assert err < 5e-6, f"{case.name}: float32 vs float64 relative error {err}"
                cond = f"  f32-vs-f64 {err:.1e}"
            entries = [
                ("d_model", np.int64(case.d_model)), ("d_k", np.int64(case.d_k)),
                ("d_v", np.int64(case.d_v)), ("h", np.int64(case.h)),
                ("masked_rows", np.int64(policy)), ("scalar_bits", np.int64(bits)),
                ("self_attention", np.int64(1 if case.self_attention else 0)),
            ]
            entries += [(n, params[n]) for n in PARAMS]
            entries += [("queries", q.double().numpy()), ("keys", k.double().numpy()),
                        ("values", v.double().numpy())]
            if mask is not None:
                entries.append(("attention_mask", mask.numpy()))
            if w is not None:
                entries.append(("attention_weights", w.double().numpy()))
            if getattr(case, "options", False):
                entries.append(("causal", np.int64(1 if case.causal else 0)))
                entries.append(("window_left", np.int64(case.window_left)))
                entries.append(("window_right", np.int64(case.window_right)))
                if case.key_lengths is not None:
                    entries.append(("key_lengths", np.array(case.key_lengths, dtype=np.int64)))
                if case.alibi is not None:
                    # float32 files hold the slopes as the float32 values the module is given.
                    entries.append(("alibi_slopes", torch.tensor(case.alibi, dtype=dtype).double().numpy()))
                if case.bias is not None:
                    entries.append(("attention_bias", to_torch(case.bias, dtype).double().numpy()))
                entries.append(("probabilities", att.double().numpy()))
            entries.append(("output", y.double().numpy()))
            blob = encode_file(entries)
            fname = f"{case.name}_f{bits}.sdpafix"
            with open(os.path.join(out_dir, fname), "wb") as f:
                f.write(blob)
            total += len(blob)
            written.append(fname)
            print(f"{fname:40s} {len(blob):7d} B  policy={'kNaN' if policy else 'kZero'}  "
                  f"sha256={hashlib.sha256(blob).hexdigest()[:16]}{cond}")
    stale = sorted(set(f for f in os.listdir(out_dir) if f.endswith(".sdpafix")) - set(written))
    for f in stale:
        os.remove(os.path.join(out_dir, f))
        print(f"removed stale {f}")
    print(f"{len(written)} fixtures, {total} bytes in {out_dir}")


def run_with(case, m, dtype, policy, q, k, v, mask, w):
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    w = None if w is None else w.to(dtype)
    if getattr(case, "options", False):
        # The float32 file's bias and slopes, rounded to float32, evaluated in dtype.
        rounded = copy.copy(case)
        if case.bias is not None:
            rounded.bias = case.bias.astype(np.float32).astype(np.float64)
        if case.alibi is not None:
            rounded.alibi = [float(np.float32(a)) for a in case.alibi]
        with torch.no_grad():
            y, _ = forward_with_options(m, rounded, q, k, v, mask, w, policy)
        return y, y, y
    with torch.no_grad():
        y_nan = m(q, k, v, mask, w)
        y_zero, scores, att = forward_zero_masked_rows(m, q, k, v, mask, w)
    return (y_nan if policy == 1 else y_zero), y_nan, y_zero


if __name__ == "__main__":
    sys.exit(main())
