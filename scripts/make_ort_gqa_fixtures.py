#!/usr/bin/env python3
"""Writes tests/fixtures/ort_gqa/*.sdpafix: ONNX Runtime's own com.microsoft.GroupQueryAttention (its CPU
kernel) on small prompts, so that tests/attention_test.cpp checks sdpa::attention against another
implementation of grouped-query attention: GQA and MQA, rotary embeddings in both layouts (rotary_interleaved)
and partial (a cos/sin cache narrower than the head), a local (sliding) window, softcap and a custom scale.

Run with a Python that has onnx and onnxruntime (a virtual environment with `pip install onnx onnxruntime
numpy`, or Debian 13's python3-onnxruntime in the ../shared/peers/ root): python3 scripts/make_ort_gqa_fixtures.py.
Prints the onnxruntime version; deterministic.

Each file: ort_version (i64 major * 10000 + minor * 100 + patch); b, s, h, kv, d, rotary_dim, interleaved,
local_window_size i64; scale, softcap f64 (0: ORT's default); q (b, s, h, d), k (b, s, kv, d), v (b, s, kv, d)
(the op's packed (b, s, heads * d) inputs, which are exactly these in memory); inv_freq (rotary_dim / 2) f64
(cos/sin caches from it, in float32, as the op takes them); output (b, s, h, d).
"""

import hashlib
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

# (The op's CPU kernel needs head sizes that are multiples of 16.)
CASES = {
    "gqa_causal": dict(b=2, s=7, h=4, kv=2, d=16),
    "mqa_causal": dict(b=1, s=9, h=4, kv=1, d=16),
    "gqa_rotary_half": dict(b=2, s=6, h=4, kv=2, d=16, rotary_dim=16),
    "gqa_rotary_interleaved": dict(b=1, s=8, h=6, kv=3, d=16, rotary_dim=16, interleaved=1),
    "gqa_rotary_partial": dict(b=2, s=5, h=4, kv=2, d=32, rotary_dim=16),
    "gqa_window": dict(b=1, s=12, h=4, kv=2, d=16, local_window_size=3),
    "gqa_softcap_scale": dict(b=2, s=6, h=4, kv=2, d=16, softcap=2.0, scale=0.6),
    "gqa_everything": dict(b=2, s=10, h=8, kv=2, d=32, rotary_dim=32, interleaved=1, local_window_size=4,
                           softcap=5.0, scale=0.3),
}


def version_number():
    major, minor, patch = (int(x) for x in ort.__version__.split(".")[:3])
    return major * 10000 + minor * 100 + patch


def run_case(name, c):
    rng = np.random.default_rng(mf.seed_of("ort_gqa/" + name))
    b, s, h, kv, d = c["b"], c["s"], c["h"], c["kv"], c["d"]
    rdim = c.get("rotary_dim", 0)
    q = rng.normal(0, 1, (b, s, h, d)).astype(np.float32)
    k = rng.normal(0, 1, (b, s, kv, d)).astype(np.float32)
    v = rng.normal(0, 1, (b, s, kv, d)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rdim, 2) / rdim)) if rdim else np.zeros(0)
    attrs = dict(num_heads=h, kv_num_heads=kv, do_rotary=1 if rdim else 0, rotary_interleaved=c.get("interleaved", 0),
                 local_window_size=c.get("local_window_size", -1))
    if c.get("scale"):
        attrs["scale"] = float(c["scale"])
    if c.get("softcap"):
        attrs["softcap"] = float(c["softcap"])
    inputs = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    graph_inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, [b, s, h * d]),
                    helper.make_tensor_value_info("key", TensorProto.FLOAT, [b, s, kv * d]),
                    helper.make_tensor_value_info("value", TensorProto.FLOAT, [b, s, kv * d]),
                    helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
                    helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    feeds = {"query": q.reshape(b, s, h * d), "key": k.reshape(b, s, kv * d), "value": v.reshape(b, s, kv * d),
             "seqlens_k": np.full((b,), s - 1, dtype=np.int32), "total_sequence_length": np.array(s, dtype=np.int32)}
    if rdim:
        inputs += ["cos_cache", "sin_cache"]
        graph_inputs += [helper.make_tensor_value_info("cos_cache", TensorProto.FLOAT, [s, rdim // 2]),
                         helper.make_tensor_value_info("sin_cache", TensorProto.FLOAT, [s, rdim // 2])]
        angle = np.arange(s, dtype=np.float32).reshape(s, 1) * inv_freq.astype(np.float32).reshape(1, -1)
        feeds["cos_cache"] = np.cos(angle).astype(np.float32)
        feeds["sin_cache"] = np.sin(angle).astype(np.float32)
    node_inputs = [n if n not in ("past_key", "past_value") else "" for n in inputs]
    node = helper.make_node("GroupQueryAttention", node_inputs, ["output", "present_key", "present_value"],
                            domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], "gqa", graph_inputs,
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [b, s, h * d]),
                               helper.make_tensor_value_info("present_key", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("present_value", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out = sess.run(["output"], feeds)[0].reshape(b, s, h, d)
    entries = [("ort_version", np.int64(version_number()))]
    for key in ("b", "s", "h", "kv", "d"):
        entries.append((key, np.int64(c[key])))
    entries += [("rotary_dim", np.int64(rdim)), ("interleaved", np.int64(c.get("interleaved", 0))),
                ("local_window_size", np.int64(c.get("local_window_size", -1))),
                ("scale", np.float64(c.get("scale", 0.0))), ("softcap", np.float64(c.get("softcap", 0.0))),
                ("q", q.astype(np.float64)), ("k", k.astype(np.float64)), ("v", v.astype(np.float64)),
                ("inv_freq", inv_freq.astype(np.float32).astype(np.float64)), ("output", out.astype(np.float64))]
    return entries


def main():
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}")
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "ort_gqa")
    os.makedirs(out_dir, exist_ok=True)
    for name, c in CASES.items():
        data = mf.encode_file(run_case(name, c))
        path = os.path.join(out_dir, name + ".sdpafix")
        with open(path, "wb") as f:
            f.write(data)
        print(f"{hashlib.sha256(data).hexdigest()[:16]}  {os.path.relpath(path)}  ({len(data)} bytes)")


if __name__ == "__main__":
    main()
