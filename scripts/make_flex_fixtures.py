#!/usr/bin/env python3
"""Writes the PyTorch FlexAttention reference fixtures of sdpa's programmable attention (score and mask
functions): tests/fixtures/flex/<case>.sdpafix, one file per case, plus tests/fixtures/flex/SOURCE.txt
(torch version, date, command).

Run with a Python that has PyTorch >= 2.5 (torch.nn.attention.flex_attention) and NumPy, e.g.

    python3 -m venv /tmp/flexvenv && /tmp/flexvenv/bin/pip install torch numpy
    /tmp/flexvenv/bin/python scripts/make_flex_fixtures.py

The .sdpafix files are deterministic (each case draws from a NumPy Generator seeded with
zlib.crc32(case name), computations run on one CPU thread); the script prints a SHA-256 of each.

File format "SDPAFIX1" (the same as scripts/make_fixtures.py and tests/support/fixture.hpp; all integers
and floats little-endian, no padding, no alignment):

    file   := magic  u32 count  entry*count          (the file ends right after the last entry)
    magic  := the 8 ASCII bytes "SDPAFIX1"
    entry  := u32 name_len  name  u8 dtype  u8 rank  i64 dims[rank]  data
    name   := name_len bytes of ASCII, no terminator; names are unique within a file
    dtype  := 0 f64 (IEEE-754 binary64) | 1 bool (u8, 0 or 1) | 2 i64
    data   := prod(dims) elements of dtype in row-major order (last index fastest); rank 0 is a scalar

Semantics (sdpa's). Tensors are (batch b, heads, n, d) ("BHND"), float64. q has h heads, k and v have
kv_heads heads (GQA: query head i reads kv head i // (h // kv_heads)). scale = 1/sqrt(d). A query with
index i (0..nq-1) has the position qpos = i + (nk - nq) (lower-right alignment); a key's index k is its
position. A mask function keep(b, h, qpos, k) is true where key k is visible to the query; a score
function score(s, b, h, qpos, k) maps s = scale * q.k (before masking). Hidden keys get -inf, then
softmax over the keys, times v. A query that sees no key gets output 0 and lse -inf (PyTorch flex's
behaviour, and sdpa's MaskedRows::kZero). PyTorch's flex_attention passes q_idx = the query *index*: the
mask_mod / score_mod below compute qpos = q_idx + (nk - nq) themselves.

Kinds (entry `kind`) and the parameters each one writes:

     1 causal              k <= qpos
     2 sliding             qpos - left <= k <= qpos + right                         left, right
     3 chunked             k <= qpos and k // chunk == qpos // chunk (Llama 4)      chunk
     4 document            doc_ids[b][qpos] == doc_ids[b][k] (not causal)          doc_ids (b, nk)
     5 document_causal     document and causal                                      doc_ids (b, nk)
     6 prefix_lm           k < prefix[b] or k <= qpos                               prefix (b,)
     7 tree                speculative-decoding draft tree: the nq queries are drafts at positions P + i,
                           P = nk - nq; parents[b][i] is -1 or a draft index j < i. Key k < P is
                           visible; key P + j is visible when j == i or j is an ancestor of i.
                                                                                    parents (b, nq)
     8 t5_bidirectional    s + table[h][bucket(k - qpos)], no mask; bucket = HF transformers'
                           T5Attention._relative_position_bucket(rel, bidirectional=True,
                           num_buckets, max_distance) (float32 logarithm, as HF)
                                                                num_buckets, max_distance, table (h, nb)
     9 t5_causal           the same with bidirectional=False, and causal
                                                                num_buckets, max_distance, table (h, nb)
    10 alibi               s - slopes[h] * |qpos - k|, and causal                   slopes (h,)
    11 softcap             softcap * tanh(s / softcap), no mask (q, k scaled by 3)  softcap (f64)
    12 distance_bias       s + table[h][clamp(k - qpos, -radius, radius) + radius], and causal
                                                                                    radius, table (h, 2r+1)
    13 sigmoid_gated       s - sigmoid(s) * |qpos - k| / 8, no mask (a test-only function)
    14 every_fourth_causal keep = (k % 4 == 0 or k == qpos) and k <= qpos (a test-only function)
    15 fully_hidden_rows   keep = k < qpos (the query at position 0 sees nothing: output 0, lse -inf)

Entries of every file:

    batch, heads, kv_heads, nq, nk, d, kind     i64 scalars
    <the kind's parameters>                     as listed above (i64 scalars unless noted)
    q (b, h, nq, d), k (b, kv_heads, nk, d), v (b, kv_heads, nk, d), d_out (b, h, nq, d)   f64 inputs,
                                                standard normal (softcap: q, k times 3)
    out (b, h, nq, d)                           flex_attention's output
    lse (b, h, nq)                              flex_attention's log-sum-exp (natural log) of the
                                                scores, -inf for a row that sees no key
    d_q, d_k, d_v                               d loss / d q, k, v for loss = sum(out * d_out)
    d_table (h, n)                              d loss / d table, where the kind has a table
    grad_source                                 i64 scalar: 1 gradients from flex_attention's backward,
                                                0 from torch autograd over a dense float64
                                                implementation (`dense_attention` below) whose output
                                                and lse were checked against flex_attention's to 1e-10

How: flex_attention (eager, no torch.compile) in float64 on the CPU, with create_block_mask(device='cpu')
and score_mod, enable_gqa=True for GQA, the log-sum-exp requested. PyTorch's flex_attention raises
"FlexAttention does not support backward on CPU" for inputs that require grad, so the script tries its
backward first and otherwise takes the gradients from the dense implementation. The masks and scores
are also checked element by element against the plain-Python statements of the semantics in `spec_keep`
and `spec_score`.
"""

import datetime
import hashlib
import math
import os
import struct
import sys
import zlib

import numpy as np
import torch
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.set_num_threads(1)
DTYPE = torch.float64
HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, os.pardir, "tests", "fixtures", "flex")

KINDS = {"causal": 1, "sliding": 2, "chunked": 3, "document": 4, "document_causal": 5, "prefix_lm": 6,
         "tree": 7, "t5_bidirectional": 8, "t5_causal": 9, "alibi": 10, "softcap": 11, "distance_bias": 12,
         "sigmoid_gated": 13, "every_fourth_causal": 14, "fully_hidden_rows": 15}


# ---------------------------------------------------------------------------------------------------
# SDPAFIX1 writing: scripts/make_fixtures.py's encoder (MAGIC, encode_file), as the other fixture scripts.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import BOOL, F64, I64, MAGIC, encode_file  # noqa: E402


def decode_file(blob):
    """The inverse of encode_file (used to read every written file back)."""
    assert blob[:8] == MAGIC
    (count,), pos, out = struct.unpack_from("<I", blob, 8), 12, {}
    for _ in range(count):
        (name_len,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        name = blob[pos:pos + name_len].decode("ascii")
        pos += name_len
        code, rank = struct.unpack_from("<BB", blob, pos)
        pos += 2
        dims = struct.unpack_from(f"<{rank}q", blob, pos)
        pos += 8 * rank
        dtype, width = {F64: ("<f8", 8), BOOL: ("u1", 1), I64: ("<i8", 8)}[code]
        n = int(np.prod(dims, dtype=np.int64))
        out[name] = np.frombuffer(blob, dtype, n, pos).reshape(dims).copy()
        pos += n * width
    assert pos == len(blob), (pos, len(blob))
    return out


# ---------------------------------------------------------------------------------------------------
# T5 buckets: HF transformers' T5Attention._relative_position_bucket, verbatim (modeling_t5.py).
def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    # now relative_position is in the range [0, inf)

    # half of the buckets are for exact increments in positions
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact

    # The other half of the buckets are for logarithmically bigger bins in positions up to max_distance
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )

    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def t5_bucket_scalar(rel, bidirectional, num_buckets, max_distance):
    """The same bucket for one Python int, with NumPy float32 arithmetic (for the element-wise check)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if rel > 0 else 0
        rel = abs(rel)
    else:
        rel = -min(rel, 0)
    max_exact = num_buckets // 2
    if rel < max_exact:
        return bucket + rel
    large = np.log(np.float32(rel) / np.float32(max_exact)) / np.float32(math.log(max_distance / max_exact))
    large = max_exact + int(np.float32(large * np.float32(num_buckets - max_exact)))
    return bucket + min(large, num_buckets - 1)


# ---------------------------------------------------------------------------------------------------
# Cases.
class Case:
    def __init__(self, name, kind, b=2, h=2, kvh=None, nq=40, nk=40, d=16, **params):
        self.name, self.kind = name, kind
        self.b, self.h, self.kvh, self.nq, self.nk, self.d = b, h, kvh or h, nq, nk, d
        self.params = params  # name -> NumPy array or Python scalar (written as given)
        self.rng = np.random.default_rng(zlib.crc32(name.encode("ascii")))
        self.q = self.rng.standard_normal((b, h, nq, d))
        self.k = self.rng.standard_normal((b, self.kvh, nk, d))
        self.v = self.rng.standard_normal((b, self.kvh, nk, d))
        self.d_out = self.rng.standard_normal((b, h, nq, d))


def doc_ids_from_lengths(lengths_per_batch, nk):
    rows = []
    for lengths in lengths_per_batch:
        assert sum(lengths) == nk, lengths
        rows.append(np.repeat(np.arange(len(lengths)), lengths))
    return np.stack(rows).astype(np.int64)


def build_cases():
    cases = [
        Case("causal", "causal"),
        Case("causal_q24_k40", "causal", nq=24, nk=40),
        Case("sliding_l5_r0", "sliding", left=5, right=0),
        Case("sliding_l3_r2", "sliding", left=3, right=2),
        Case("chunked_c8", "chunked", chunk=8),
        Case("document", "document", doc_ids=doc_ids_from_lengths([[9, 14, 17], [5, 20, 3, 12]], 40)),
        Case("document_causal", "document_causal",
             doc_ids=doc_ids_from_lengths([[12, 1, 15, 12], [22, 18]], 40)),
        Case("prefix_lm", "prefix_lm", prefix=np.array([10, 23], np.int64)),
        Case("prefix_lm_q24_k40", "prefix_lm", nq=24, nk=40, prefix=np.array([20, 31], np.int64)),
        Case("tree", "tree", nq=7, nk=40,
             parents=np.array([[-1, 0, 0, 1, 1, 2, 5], [-1, -1, 1, 2, 0, 4, 3]], np.int64)),
        Case("t5_bidirectional", "t5_bidirectional", num_buckets=8, max_distance=16),
        Case("t5_causal", "t5_causal", num_buckets=8, max_distance=20),
        Case("alibi_causal", "alibi", slopes=np.array([2.0 ** (-8 * (i + 1) / 2) for i in range(2)])),
        Case("softcap", "softcap", softcap=2.0),
        Case("distance_bias", "distance_bias", radius=6),
        Case("sigmoid_gated", "sigmoid_gated"),
        Case("every_fourth_causal", "every_fourth_causal"),
        Case("gqa_chunked_c8", "chunked", h=4, kvh=2, chunk=8),
        Case("gqa_document_causal", "document_causal", h=4, kvh=2,
             doc_ids=doc_ids_from_lengths([[6, 10, 24], [17, 4, 19]], 40)),
        Case("fully_hidden_rows", "fully_hidden_rows"),
    ]
    for c in cases:  # parameters drawn after the inputs, from the same generator
        if c.kind in ("t5_bidirectional", "t5_causal"):
            c.params["table"] = c.rng.standard_normal((c.h, c.params["num_buckets"]))
        if c.kind == "distance_bias":
            c.params["table"] = c.rng.standard_normal((c.h, 2 * c.params["radius"] + 1))
        if c.kind == "softcap":  # large enough logits that the cap matters
            c.q, c.k = 3.0 * c.q, 3.0 * c.k
    return cases


# ---------------------------------------------------------------------------------------------------
# The semantics, in plain Python, one element at a time (the specification the tensors are checked against).
def ancestors_or_self(parents_row, i):
    seen = set()
    while i >= 0:
        seen.add(i)
        i = int(parents_row[i])
    return seen


def spec_keep(c, b, h, qpos, k):
    p, kind = c.params, c.kind
    if kind == "causal":
        return k <= qpos
    if kind == "sliding":
        return qpos - p["left"] <= k <= qpos + p["right"]
    if kind == "chunked":
        return k <= qpos and k // p["chunk"] == qpos // p["chunk"]
    if kind == "document":
        return p["doc_ids"][b][qpos] == p["doc_ids"][b][k]
    if kind == "document_causal":
        return p["doc_ids"][b][qpos] == p["doc_ids"][b][k] and k <= qpos
    if kind == "prefix_lm":
        return k < p["prefix"][b] or k <= qpos
    if kind == "tree":
        base = c.nk - c.nq
        return k < base or (k - base) in ancestors_or_self(p["parents"][b], qpos - base)
    if kind in ("t5_causal", "alibi", "distance_bias"):
        return k <= qpos
    if kind in ("t5_bidirectional", "softcap", "sigmoid_gated"):
        return True
    if kind == "every_fourth_causal":
        return (k % 4 == 0 or k == qpos) and k <= qpos
    if kind == "fully_hidden_rows":
        return k < qpos
    raise ValueError(kind)


def spec_score(c, s, b, h, qpos, k):
    p, kind = c.params, c.kind
    if kind in ("t5_bidirectional", "t5_causal"):
        bucket = t5_bucket_scalar(k - qpos, kind == "t5_bidirectional", p["num_buckets"], p["max_distance"])
        return s + p["table"][h][bucket]
    if kind == "alibi":
        return s - p["slopes"][h] * abs(qpos - k)
    if kind == "softcap":
        return p["softcap"] * math.tanh(s / p["softcap"])
    if kind == "distance_bias":
        r = p["radius"]
        return s + p["table"][h][min(max(k - qpos, -r), r) + r]
    if kind == "sigmoid_gated":
        return s - abs(qpos - k) / 8 / (1 + math.exp(-s))
    return s


# ---------------------------------------------------------------------------------------------------
# The same functions as flex_attention mask_mod / score_mod. They take index tensors: 0-d ones from
# flex_attention (which vmaps over b, h, q_idx, kv_idx), or broadcasting ones from dense_attention.
def make_mods(c, t):
    """t: name -> torch tensor of the case's array parameters (the table may require grad).
    Returns (mask_mod or None, score_mod or None)."""
    p, kind, offset = c.params, c.kind, c.nk - c.nq

    def mask_mod(b, h, q_idx, kv_idx):
        qpos = q_idx + offset
        if kind in ("causal", "t5_causal", "alibi", "distance_bias"):
            return kv_idx <= qpos
        if kind == "sliding":
            return (kv_idx >= qpos - p["left"]) & (kv_idx <= qpos + p["right"])
        if kind == "chunked":
            return (kv_idx <= qpos) & (kv_idx // p["chunk"] == qpos // p["chunk"])
        if kind == "document":
            return t["doc_ids"][b, qpos] == t["doc_ids"][b, kv_idx]
        if kind == "document_causal":
            return (t["doc_ids"][b, qpos] == t["doc_ids"][b, kv_idx]) & (kv_idx <= qpos)
        if kind == "prefix_lm":
            return (kv_idx < t["prefix"][b]) | (kv_idx <= qpos)
        if kind == "tree":  # t["ancestors"][b, i, j]: draft j is i or an ancestor of draft i
            j = torch.clamp(kv_idx - offset, min=0)
            return (kv_idx < offset) | t["ancestors"][b, q_idx, j]
        if kind == "every_fourth_causal":
            return ((kv_idx % 4 == 0) | (kv_idx == qpos)) & (kv_idx <= qpos)
        if kind == "fully_hidden_rows":
            return kv_idx < qpos
        raise ValueError(kind)

    def score_mod(s, b, h, q_idx, kv_idx):
        qpos = q_idx + offset
        if kind in ("t5_bidirectional", "t5_causal"):
            bucket = _relative_position_bucket(kv_idx - qpos, kind == "t5_bidirectional",
                                               p["num_buckets"], p["max_distance"])
            return s + t["table"][h, bucket]
        if kind == "alibi":
            return s - t["slopes"][h] * torch.abs(qpos - kv_idx).to(s.dtype)
        if kind == "softcap":
            return p["softcap"] * torch.tanh(s / p["softcap"])
        if kind == "distance_bias":
            r = p["radius"]
            return s + t["table"][h, torch.clamp(kv_idx - qpos, -r, r) + r]
        if kind == "sigmoid_gated":
            return s - torch.sigmoid(s) * torch.abs(qpos - kv_idx).to(s.dtype) / 8
        raise ValueError(kind)

    has_mask = kind not in ("t5_bidirectional", "softcap", "sigmoid_gated")
    has_score = kind in ("t5_bidirectional", "t5_causal", "alibi", "softcap", "distance_bias", "sigmoid_gated")
    return (mask_mod if has_mask else None), (score_mod if has_score else None)


def param_tensors(c, table_requires_grad=False):
    t = {}
    for name in ("doc_ids", "prefix"):
        if name in c.params:
            t[name] = torch.from_numpy(c.params[name])
    if "slopes" in c.params:
        t["slopes"] = torch.from_numpy(c.params["slopes"]).to(DTYPE)
    if "table" in c.params:
        t["table"] = torch.from_numpy(c.params["table"]).to(DTYPE).requires_grad_(table_requires_grad)
    if "parents" in c.params:
        anc = np.zeros((c.b, c.nq, c.nq), np.bool_)
        for b in range(c.b):
            for i in range(c.nq):
                for j in ancestors_or_self(c.params["parents"][b], i):
                    anc[b, i, j] = True
        t["ancestors"] = torch.from_numpy(anc)
    return t


def index_grids(c):
    b = torch.arange(c.b).view(-1, 1, 1, 1)
    h = torch.arange(c.h).view(1, -1, 1, 1)
    q_idx = torch.arange(c.nq).view(1, 1, -1, 1)
    kv_idx = torch.arange(c.nk).view(1, 1, 1, -1)
    return b, h, q_idx, kv_idx


def dense_attention(c, q, k, v, t):
    """Dense float64 attention with the case's functions; returns (out, lse, keep)."""
    mask_mod, score_mod = make_mods(c, t)
    groups = c.h // c.kvh
    k_full, v_full = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = (q @ k_full.transpose(-1, -2)) / math.sqrt(c.d)
    b, h, q_idx, kv_idx = index_grids(c)
    if score_mod is not None:
        s = score_mod(s, b, h, q_idx, kv_idx)
    shape = (c.b, c.h, c.nq, c.nk)
    keep = torch.ones(shape, dtype=torch.bool) if mask_mod is None else \
        torch.broadcast_to(mask_mod(b, h, q_idx, kv_idx), shape)
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    hidden_row = ~keep.any(dim=-1, keepdim=True)
    s = torch.where(hidden_row, torch.zeros_like(s), s)  # no NaN from a softmax of all -inf
    p = torch.softmax(s, dim=-1)
    p = torch.where(hidden_row, torch.zeros_like(p), p)  # such a row gives 0, as flex_attention does
    return p @ v_full, lse, keep


def run_flex(c, q, k, v, t):
    mask_mod, score_mod = make_mods(c, t)
    block_mask = None if mask_mod is None else \
        create_block_mask(mask_mod, c.b, c.h, c.nq, c.nk, device="cpu")
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=1.0 / math.sqrt(c.d),
                  enable_gqa=c.h != c.kvh)
    if hasattr(flex_module, "AuxRequest"):  # newer PyTorch: return_aux; older: return_lse
        out, aux = flex_attention(q, k, v, return_aux=flex_module.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return flex_attention(q, k, v, return_lse=True, **kwargs)


def compute(c):
    np_inputs = (c.q, c.k, c.v)

    # Forward with flex_attention.
    t = param_tensors(c)
    q, k, v = (torch.from_numpy(x) for x in np_inputs)
    with torch.no_grad():
        out, lse = run_flex(c, q, k, v, t)
    assert out.dtype == DTYPE and lse.dtype == DTYPE, (out.dtype, lse.dtype)

    # Gradients from flex_attention's backward when it has one on the CPU.
    grads, grad_source, flex_backward_error = None, 0, None
    try:
        t = param_tensors(c, table_requires_grad=True)
        q, k, v = (torch.from_numpy(x).requires_grad_(True) for x in np_inputs)
        out_g, _ = run_flex(c, q, k, v, t)
        out_g.backward(torch.from_numpy(c.d_out))
        grads = {"d_q": q.grad, "d_k": k.grad, "d_v": v.grad}
        if "table" in t:
            grads["d_table"] = t["table"].grad
        grad_source = 1
    except (NotImplementedError, RuntimeError) as e:
        flex_backward_error = f"{type(e).__name__}: {str(e).splitlines()[0]}"

    # The dense implementation, checked against flex_attention; its autograd gives the gradients.
    t = param_tensors(c, table_requires_grad=True)
    q, k, v = (torch.from_numpy(x).requires_grad_(True) for x in np_inputs)
    out_d, lse_d, keep = dense_attention(c, q, k, v, t)
    err_out = (out_d.detach() - out).abs().max().item()
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(lse_d.detach())), c.name
    assert torch.all(lse[~finite] == -math.inf) and torch.all(lse_d.detach()[~finite] == -math.inf)
    err_lse = (lse_d.detach()[finite] - lse[finite]).abs().max().item()
    assert err_out < 1e-10 and err_lse < 1e-10, (c.name, err_out, err_lse)
    if grads is None:
        out_d.backward(torch.from_numpy(c.d_out))
        grads = {"d_q": q.grad, "d_k": k.grad, "d_v": v.grad}
        if "table" in t:
            grads["d_table"] = t["table"].grad
    for name, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), (c.name, name)

    # Element-wise check of the mask and the scores against the plain-Python semantics.
    offset = c.nk - c.nq
    keep_np = keep.numpy()
    groups = c.h // c.kvh
    s_raw = np.einsum("bhqd,bhkd->bhqk", c.q, np.repeat(c.k, groups, axis=1)) / math.sqrt(c.d)
    _, score_mod = make_mods(c, param_tensors(c))
    s_mod = s_raw if score_mod is None else \
        torch.broadcast_to(score_mod(torch.from_numpy(s_raw), *index_grids(c)), s_raw.shape).numpy()
    for b in range(c.b):
        for h in range(c.h):
            for i in range(c.nq):
                for j in range(c.nk):
                    assert keep_np[b, h, i, j] == spec_keep(c, b, h, i + offset, j), (c.name, b, h, i, j)
                    want = spec_score(c, s_raw[b, h, i, j], b, h, i + offset, j)
                    assert abs(s_mod[b, h, i, j] - want) <= 1e-12 * max(1.0, abs(want)), (c.name, b, h, i, j)
    hidden_rows = int((~keep_np.any(-1)).sum())
    assert (hidden_rows > 0) == (c.kind == "fully_hidden_rows"), (c.name, hidden_rows)

    return out.numpy(), lse.numpy(), {n: g.detach().numpy() for n, g in grads.items()}, grad_source, \
        flex_backward_error, hidden_rows, (err_out, err_lse)


def entries_of(c, out, lse, grads, grad_source):
    e = [("batch", np.int64(c.b)), ("heads", np.int64(c.h)), ("kv_heads", np.int64(c.kvh)),
         ("nq", np.int64(c.nq)), ("nk", np.int64(c.nk)), ("d", np.int64(c.d)), ("kind", np.int64(KINDS[c.kind]))]
    for name, value in c.params.items():
        if isinstance(value, float):
            value = np.float64(value)
        elif isinstance(value, int):
            value = np.int64(value)
        e.append((name, value))
    e += [("q", c.q), ("k", c.k), ("v", c.v), ("d_out", c.d_out), ("out", out), ("lse", lse)]
    e += [(name, grads[name]) for name in ("d_q", "d_k", "d_v", "d_table") if name in grads]
    e.append(("grad_source", np.int64(grad_source)))
    return e


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    print(f"torch {torch.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}")
    backward_notes = set()
    for c in build_cases():
        out, lse, grads, grad_source, err, hidden_rows, (err_out, err_lse) = compute(c)
        if err:
            backward_notes.add(err)
        blob = encode_file(entries_of(c, out, lse, grads, grad_source))
        path = os.path.join(OUT_DIR, c.name + ".sdpafix")
        with open(path, "wb") as f:
            f.write(blob)
        with open(path, "rb") as f:  # read back and compare
            back = decode_file(f.read())
        np.testing.assert_array_equal(back["out"], out)
        np.testing.assert_array_equal(back["lse"], lse)
        assert back["kind"] == KINDS[c.kind] and back["q"].shape == c.q.shape
        print(f"  {c.name:22s} kind {KINDS[c.kind]:2d} h {c.h} kv {c.kvh} nq {c.nq:2d} nk {c.nk:2d} "
              f"grad_source {grad_source} |flex-dense| out {err_out:.1e} lse {err_lse:.1e} "
              f"hidden rows {hidden_rows} {len(blob)} bytes sha256={hashlib.sha256(blob).hexdigest()[:16]}")
    for note in sorted(backward_notes):
        print(f"flex_attention backward on the CPU: {note}")
    source = os.path.join(OUT_DIR, "SOURCE.txt")
    with open(source, "w") as f:
        f.write("# tests/fixtures/flex/*.sdpafix: PyTorch FlexAttention references, see the docstring of "
                "scripts/make_flex_fixtures.py\n")
        f.write(f"torch {torch.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}\n")
        f.write(f"generated {datetime.date.today().isoformat()}\n")
        f.write("command: python3 scripts/make_flex_fixtures.py  (from the repository root, with a Python "
                "that has torch and numpy)\n")
        for note in sorted(backward_notes):
            f.write(f"gradients: dense float64 autograd (grad_source 0); flex_attention's CPU backward: {note}\n")
    print(f"wrote {OUT_DIR}")


if __name__ == "__main__":
    main()
