#!/usr/bin/env python3
"""Writes PyTorch weights as safetensors with nothing but torch and the standard library, for sdpa's
load_safetensors (include/sdpa/io/safetensors.hpp); the `safetensors` package is not needed.

    export_pytorch.py export CHECKPOINT OUT [--select PREFIX] [--dtype F32|F64|F16|BF16] [--metadata k=v ...]
        a .pt file holding a state_dict (also under "state_dict" or "model") or a pickled nn.Module
    export_pytorch.py fixtures [--out tests/fixtures/safetensors] [--corpus tests/fuzz/corpus]
        the committed test fixtures and the fuzzer's seed corpus (deterministic, byte-identical reruns)
    export_pytorch.py show FILE
        prints a safetensors file's header, to check files written by sdpa's save_safetensors

Run with a Python that has PyTorch (on Debian: /usr/bin/python3 scripts/models/export_pytorch.py ...).

The layout is the reference implementation's (huggingface/safetensors): an 8-byte little-endian header
length N, N bytes of compact JSON ({"__metadata__": {...}} first, then one {"dtype", "shape",
"data_offsets"} object per tensor) padded with spaces to a multiple of 8, then the tensors' bytes,
little-endian, row-major, contiguous and in the header's order: larger elements first (so each tensor
stays aligned to its element size), then by name. For one dtype this is plain name order, which is what
sdpa's save_safetensors writes, so both produce the same bytes for the same tensors.
"""

import argparse
import hashlib
import json
import os
import struct
import sys

import numpy as np
import torch
from torch import nn
from torch.nn import init


# ---------------------------------------------------------------------------------------------------
# The reference, External-Attention-pytorch's ScaledDotProductAttention.
class ScaledDotProductAttention(nn.Module):
    def __init__(self, d_model, d_k, d_v, h, dropout=.1):
        super().__init__()
        self.fc_q = nn.Linear(d_model, h * d_k); self.fc_k = nn.Linear(d_model, h * d_k)
        self.fc_v = nn.Linear(d_model, h * d_v); self.fc_o = nn.Linear(h * d_v, d_model)
        self.dropout = nn.Dropout(dropout); self.d_model, self.d_k, self.d_v, self.h = d_model, d_k, d_v, h
        self.init_weights()
    def init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                init.normal_(m.weight, std=0.001)
                if m.bias is not None: init.constant_(m.bias, 0)
    def forward(self, queries, keys, values, attention_mask=None, attention_weights=None):
        b_s, nq = queries.shape[:2]; nk = keys.shape[1]
        q = self.fc_q(queries).view(b_s, nq, self.h, self.d_k).permute(0, 2, 1, 3)
        k = self.fc_k(keys).view(b_s, nk, self.h, self.d_k).permute(0, 2, 3, 1)
        v = self.fc_v(values).view(b_s, nk, self.h, self.d_v).permute(0, 2, 1, 3)
        att = torch.matmul(q, k) / np.sqrt(self.d_k)
        if attention_weights is not None: att = att * attention_weights
        if attention_mask is not None: att = att.masked_fill(attention_mask, -np.inf)
        att = torch.softmax(att, -1); att = self.dropout(att)
        out = torch.matmul(att, v).permute(0, 2, 1, 3).contiguous().view(b_s, nq, self.h * self.d_v)
        return self.fc_o(out)


# ---------------------------------------------------------------------------------------------------
# Writing and reading safetensors.
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
CAST = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MAX_HEADER = 100_000_000  # the reference implementation's limit, and sdpa's


def tensor_bytes(t):
    """The tensor's elements as little-endian bytes in row-major order."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    raw = t.view(torch.uint8)  # same storage, one byte per element byte (works for bf16, which numpy lacks)
    if sys.byteorder != "little" and t.element_size() > 1:
        raw = raw.reshape(-1, t.element_size()).flip(1).reshape(-1)
    return raw.numpy().tobytes()


def encode_safetensors(state_dict, metadata=None):
    """The bytes of a safetensors file holding state_dict's tensors (name -> torch.Tensor)."""
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved for the metadata and cannot name a tensor")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: not a tensor but {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
    header = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must map strings to strings, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    order = sorted(state_dict, key=lambda n: (-state_dict[n].element_size(), n))
    chunks, offset = [], 0
    for name in order:
        t = state_dict[name]
        data = tensor_bytes(t)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": [int(d) for d in t.shape],
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        raise ValueError(f"header of {len(text)} bytes exceeds the {MAX_HEADER}-byte limit of readers")
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def save_safetensors(state_dict, path, metadata=None):
    """Writes state_dict (name -> tensor) to path as safetensors; metadata maps strings to strings.
    The file is written next to path and renamed over it, so a failure never leaves half a file."""
    data = encode_safetensors(state_dict, metadata)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return data


def load_safetensors(path):
    """(tensors, metadata) of a safetensors file; checks the layout like sdpa's reader, less thoroughly."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or 8 + n > len(data):
        raise ValueError(f"{path}: bad header length {n}")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    buffer = data[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    tensors, cursor = {}, 0
    for name, info in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = info["data_offsets"]
        if begin != cursor or end < begin:
            raise ValueError(f"{path}: {name} does not continue the buffer at byte {cursor}")
        cursor = end
        dtype = TORCH_DTYPES[info["dtype"]]
        flat = torch.frombuffer(bytearray(buffer[begin:end]), dtype=torch.uint8)
        if sys.byteorder != "little" and dtype.itemsize > 1:
            flat = flat.reshape(-1, dtype.itemsize).flip(1).reshape(-1)
        tensors[name] = (flat.view(dtype) if end > begin else torch.empty(0, dtype=dtype)).reshape(info["shape"])
    if cursor != len(buffer):
        raise ValueError(f"{path}: {len(buffer) - cursor} bytes after the last tensor")
    return tensors, metadata


def sdpa_shape_metadata(module, prefix=""):
    """The metadata sdpa's save_safetensors writes for each ScaledDotProductAttention in a module (any
    module with d_model, d_k, d_v, h and fc_q): "<its state_dict prefix>sdpa.d_model" etc., which sdpa's
    load_safetensors checks against the module it loads into; sdpa.kv_heads is the module's kv_heads, or h
    for the original module."""
    out = {}
    for name, m in module.named_modules():
        if all(hasattr(m, a) for a in ("d_model", "d_k", "d_v", "h", "fc_q")):
            base = prefix + (name + "." if name else "")
            for a in ("d_model", "d_k", "d_v", "h"):
                out[f"{base}sdpa.{a}"] = str(int(getattr(m, a)))
            out[f"{base}sdpa.kv_heads"] = str(int(getattr(m, "kv_heads", m.h)))
    return out


def state_dict_of(obj):
    """The tensors of a torch.load result: a module, a state_dict, or a dict holding one."""
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), dict) and obj[key] and all(isinstance(v, torch.Tensor) for v in obj[key].values()):
                return obj[key]
        if all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
    raise TypeError(f"no state_dict found in a {type(obj).__name__}")


# ---------------------------------------------------------------------------------------------------
# Fixtures of tests/safetensors_test.cpp and examples/load_pytorch.cpp.
D_MODEL, D_K, D_V, H = 16, 4, 6, 2  # d_k != d_v, so swapped or transposed weights cannot go unnoticed
BATCH, NQ, NK = 2, 5, 7
PREFIX = "encoder.layers.0.attn."
REFERENCE_PREFIX = "f32_reference."  # F16/BF16 files: the same weights converted to F32 by PyTorch
PARAMS = ["fc_q.weight", "fc_q.bias", "fc_k.weight", "fc_k.bias",
          "fc_v.weight", "fc_v.bias", "fc_o.weight", "fc_o.bias"]


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = ScaledDotProductAttention(D_MODEL, D_K, D_V, H)
        self.norm = nn.LayerNorm(D_MODEL)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer()])


class Model(nn.Module):
    """A wrapper, so that the attention's tensors sit under PREFIX among others (LayerNorm, a head, an
    integer buffer) that a loader must leave alone."""

    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(D_MODEL, 3)
        self.register_buffer("steps", torch.tensor(1234, dtype=torch.int64))


def fixture_metadata(dtype):
    # "producer" keeps this script's path when the committed fixtures were written (scripts/export_pytorch.py),
    # so that a rerun still writes byte-identical files.
    return {"format": "pt", "dtype": dtype, "prefix": PREFIX, "d_model": str(D_MODEL), "d_k": str(D_K),
            "d_v": str(D_V), "h": str(H), "producer": "scripts/export_pytorch.py"}


def attn_forward(attn, q, k, v):
    attn.eval()
    with torch.no_grad():
        return attn(q, k, v)


# Bit patterns whose conversion the test checks: zeros, the smallest and largest subnormals, the smallest
# normal, one, the largest finite, infinities, quiet and signalling NaNs with payloads, a rounding value.
F16_BITS = [0x0000, 0x8000, 0x0001, 0x8001, 0x0155, 0x03FF, 0x83FF, 0x0400, 0x3C00, 0xBC00, 0x3555,
            0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7D55, 0x7FFF]
BF16_BITS = [0x0000, 0x8000, 0x0001, 0x8001, 0x0055, 0x007F, 0x807F, 0x0080, 0x3F80, 0xBF80, 0x3EAB,
             0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FAA, 0x7FFF]


def bits_tensor(bits, dtype):
    signed = [b - 0x10000 if b >= 0x8000 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int16).view(dtype)


def write(path, state_dict, metadata=None):
    data = save_safetensors(state_dict, path, metadata)
    print(f"{hashlib.sha256(data).hexdigest()[:16]}  {len(data):6d}  {path}")


def make_fixtures(out, corpus):
    torch.set_num_threads(1)
    torch.manual_seed(20240601)
    os.makedirs(out, exist_ok=True)

    model = Model().double()
    with torch.no_grad():
        # The original init (N(0, 0.001), zero biases) gives nearly uniform attention and outputs of ~1e-6;
        # these weights make the softmax peaked, so a wrong head split or transposition shows.
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * (0.3 if name.endswith("weight") else 0.1))
    attn = model.encoder.layers[0].attn

    q64 = torch.randn(BATCH, NQ, D_MODEL, dtype=torch.float64)
    k64 = torch.randn(BATCH, NK, D_MODEL, dtype=torch.float64)
    v64 = torch.randn(BATCH, NK, D_MODEL, dtype=torch.float64)
    q32, k32, v32 = q64.float(), k64.float(), v64.float()

    io = {"queries_f64": q64, "keys_f64": k64, "values_f64": v64,
          "queries_f32": q32, "keys_f32": k32, "values_f32": v32,
          "output_f64": attn_forward(attn, q64, k64, v64)}
    for dtype in ("F64", "F32", "F16", "BF16"):
        cast = CAST[dtype]
        sd = {n: (t.to(cast) if t.is_floating_point() else t) for n, t in model.state_dict().items()}
        if dtype in ("F16", "BF16"):
            # What the F16/BF16 tensors are exactly, as float32: the loader must reproduce these bits.
            for p in PARAMS:
                sd[REFERENCE_PREFIX + p] = sd[PREFIX + p].float()
        write(os.path.join(out, f"sdpa_{dtype.lower()}.safetensors"), sd, fixture_metadata(dtype))
        if dtype != "F64":
            # PyTorch's float32 forward of the weights as stored (F16/BF16 widened exactly to float32).
            f32 = ScaledDotProductAttention(D_MODEL, D_K, D_V, H)
            f32.load_state_dict({p: sd[PREFIX + p].float() for p in PARAMS})
            io[f"output_{dtype.lower()}"] = attn_forward(f32, q32, k32, v32)
    # Only the attention's tensors, as sdpa's save_safetensors(module, path, PREFIX, {"format": "pt"})
    # writes them: the test checks that both give the same bytes.
    write(os.path.join(out, "sdpa_f32_attn_only.safetensors"),
          {PREFIX + p: t.float() for p, t in attn.state_dict().items()},
          dict(sorted({"format": "pt", **sdpa_shape_metadata(attn, PREFIX)}.items())))
    write(os.path.join(out, "sdpa_io.safetensors"), io,
          {"format": "pt", "note": "inputs and PyTorch eval outputs of the sdpa_*.safetensors models"})

    special = {"f16_bits": bits_tensor(F16_BITS, torch.float16), "bf16_bits": bits_tensor(BF16_BITS, torch.bfloat16)}
    special["f16_as_f32"] = special["f16_bits"].float()
    special["bf16_as_f32"] = special["bf16_bits"].float()
    write(os.path.join(out, "special_values.safetensors"), special, {"note": "PyTorch's float() of the bits"})

    if corpus:
        make_corpus(corpus)


def make_corpus(corpus):
    """Seeds for tests/fuzz/safetensors_fuzzer.cpp, whose module is ScaledDotProductAttention<float>(4, 2,
    2, 2): valid files of every dtype, with and without a prefix, and a few broken ones."""
    os.makedirs(corpus, exist_ok=True)
    torch.manual_seed(7)
    small = ScaledDotProductAttention(4, 2, 2, 2)
    sd = small.state_dict()
    seeds = {}
    for dtype in ("F32", "F64", "F16", "BF16"):
        seeds[f"valid_{dtype.lower()}"] = encode_safetensors({n: t.to(CAST[dtype]) for n, t in sd.items()})
    seeds["valid_prefixed"] = encode_safetensors({"m." + n: t for n, t in sd.items()} | {"x": torch.zeros(2, dtype=torch.int8)},
                                                 {"format": "pt"})
    seeds["valid_mixed"] = encode_safetensors({n: t.half() if "bias" in n else t for n, t in sd.items()})
    good = seeds["valid_f32"]
    n = struct.unpack("<Q", good[:8])[0]
    seeds["truncated"] = good[:len(good) // 2]
    seeds["short"] = good[:5]
    seeds["bad_json"] = struct.pack("<Q", 8) + b'{"a" :1}'
    seeds["empty_header"] = struct.pack("<Q", 8) + b"{}      "
    seeds["overlap"] = (lambda h: struct.pack("<Q", len(h)) + h + bytes(8))(
        b'{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}')
    seeds["nested"] = (lambda h: struct.pack("<Q", len(h)) + h)(b'{"a":' + b"[" * 40 + b"]" * 40 + b"}")
    seeds["wrong_shape"] = encode_safetensors({n: t.reshape(-1) for n, t in sd.items()})
    seeds["huge_header_len"] = struct.pack("<Q", 1 << 62) + good[8:64]
    seeds["header_only"] = good[:8 + n]
    for name, data in seeds.items():
        path = os.path.join(corpus, name + ".safetensors")
        with open(path, "wb") as f:
            f.write(data)
        print(f"{hashlib.sha256(data).hexdigest()[:16]}  {len(data):6d}  {path}")


# ---------------------------------------------------------------------------------------------------
def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's state_dict as safetensors")
    ex.add_argument("checkpoint")
    ex.add_argument("out")
    ex.add_argument("--select", default="", help="keep only tensors whose names start with this")
    ex.add_argument("--dtype", choices=sorted(CAST), help="convert floating-point tensors to this dtype")
    ex.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    ex.add_argument("--allow-pickle", action="store_true",
                    help="load full pickles (needed for a saved nn.Module; runs code from the file)")
    fx = sub.add_parser("fixtures", help="write sdpa's test fixtures and fuzz corpus")
    fx.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "safetensors"))
    fx.add_argument("--corpus", default=os.path.join(root, "tests", "fuzz", "corpus"))
    sh = sub.add_parser("show", help="print a safetensors file's header and tensor summaries")
    sh.add_argument("file")
    args = parser.parse_args(argv)

    if args.command == "export":
        obj = torch.load(args.checkpoint, map_location="cpu", weights_only=not args.allow_pickle)
        sd = {n: t for n, t in state_dict_of(obj).items() if n.startswith(args.select)}
        if args.dtype:
            sd = {n: (t.to(CAST[args.dtype]) if t.is_floating_point() else t) for n, t in sd.items()}
        metadata = dict(kv.split("=", 1) for kv in args.metadata)
        metadata.setdefault("format", "pt")
        if isinstance(obj, nn.Module):
            shapes = sdpa_shape_metadata(obj)
            metadata.update({k: v for k, v in shapes.items() if k.startswith(args.select)})
        write(args.out, sd, metadata)
    elif args.command == "fixtures":
        make_fixtures(args.out, args.corpus)
    else:
        tensors, metadata = load_safetensors(args.file)
        print("metadata:", json.dumps(metadata, sort_keys=True))
        for name, t in sorted(tensors.items()):
            print(f"{name}: {DTYPES[t.dtype]} {tuple(t.shape)} sum={t.double().sum().item():.9g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
