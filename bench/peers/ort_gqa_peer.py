#!/usr/bin/env python3
"""ONNX Runtime's com.microsoft.GroupQueryAttention with the projections around it, on decoder_bench's
configurations (d_model 512, h 8, d_k 64, float, 1 thread), for the decoder suite (bench/run.py --suite
decoder, bench/results/decoder.md):

    step     one token against `cache` past entries (past_key / past_value bound to the present outputs,
             so ORT updates its cache in place, its fastest decoding setup), kv_heads 8 or 2, rotary on/off
    forward  a causal prompt of n tokens (no past), kv_heads 2, rotary on/off

The graph: q = x Wq^T + bq, k = x Wk^T + bk, v = x Wv^T + bv (MatMul + Add), GroupQueryAttention (do_rotary
with cos/sin caches of theta 10000), y = att Wo^T + bo. Prints one JSON line per case:
{"case", "ort", "min_ms", "median_ms", "runs"}. Run with any Python that has onnx and onnxruntime:
    python3 bench/peers/ort_gqa_peer.py [--repetitions 20] [--cases step,forward]
"""

import argparse
import json
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

D_MODEL, H, D = 512, 8, 64


def build(kv, rotary, with_past, max_len):
    rng = np.random.default_rng(1)
    init = []

    def weight(name, rows, cols):
        # (in, out): MatMul computes x W, x being (1, n, in).
        init.append(numpy_helper.from_array((rng.uniform(-1, 1, (cols, rows)) / np.sqrt(cols)).astype(np.float32), name))
        init.append(numpy_helper.from_array(np.zeros(rows, dtype=np.float32), name + "_b"))

    weight("wq", H * D, D_MODEL)
    weight("wk", kv * D, D_MODEL)
    weight("wv", kv * D, D_MODEL)
    weight("wo", D_MODEL, H * D)
    nodes = []
    for name, src in (("q", "wq"), ("k", "wk"), ("v", "wv")):
        nodes.append(helper.make_node("MatMul", ["x", src], [name + "_mm"]))
        nodes.append(helper.make_node("Add", [name + "_mm", src + "_b"], [name]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, D_MODEL]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    gqa_inputs = ["q", "k", "v", "", "", "seqlens_k", "total_sequence_length"]
    if with_past:
        inputs += [helper.make_tensor_value_info("past_key", TensorProto.FLOAT, [1, kv, max_len, D]),
                   helper.make_tensor_value_info("past_value", TensorProto.FLOAT, [1, kv, max_len, D])]
        gqa_inputs[3], gqa_inputs[4] = "past_key", "past_value"
    if rotary:
        angle = np.arange(max_len, dtype=np.float32).reshape(-1, 1) / (10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
        init.append(numpy_helper.from_array(np.cos(angle).astype(np.float32), "cos"))
        init.append(numpy_helper.from_array(np.sin(angle).astype(np.float32), "sin"))
        gqa_inputs += ["cos", "sin"]
    nodes.append(helper.make_node("GroupQueryAttention", gqa_inputs, ["att", "present_key", "present_value"],
                                  domain="com.microsoft", num_heads=H, kv_num_heads=kv, do_rotary=1 if rotary else 0))
    nodes.append(helper.make_node("MatMul", ["att", "wo"], ["y_mm"]))
    nodes.append(helper.make_node("Add", ["y_mm", "wo_b"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, D_MODEL]),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "gqa_block", inputs, outputs, init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def timed(run, repetitions):
    run()
    times = []
    for _ in range(repetitions):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def step_case(kv, rotary, cache, repetitions):
    max_len = cache + 1
    sess = build(kv, rotary, True, max_len)
    rng = np.random.default_rng(2)
    past_k = ort.OrtValue.ortvalue_from_numpy(rng.normal(0, 1, (1, kv, max_len, D)).astype(np.float32))
    past_v = ort.OrtValue.ortvalue_from_numpy(rng.normal(0, 1, (1, kv, max_len, D)).astype(np.float32))
    x = ort.OrtValue.ortvalue_from_numpy(rng.uniform(-1, 1, (1, 1, D_MODEL)).astype(np.float32))
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x)
    binding.bind_cpu_input("seqlens_k", np.array([cache], dtype=np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(cache + 1, dtype=np.int32))
    binding.bind_ortvalue_input("past_key", past_k)
    binding.bind_ortvalue_input("past_value", past_v)
    binding.bind_ortvalue_output("present_key", past_k)  # in place: ORT shares the buffer
    binding.bind_ortvalue_output("present_value", past_v)
    binding.bind_output("y")
    return timed(lambda: sess.run_with_iobinding(binding), repetitions)


def forward_case(kv, rotary, n, repetitions):
    sess = build(kv, rotary, False, n)
    x = np.random.default_rng(3).uniform(-1, 1, (1, n, D_MODEL)).astype(np.float32)
    feeds = {"x": x, "seqlens_k": np.array([n - 1], dtype=np.int32), "total_sequence_length": np.array(n, dtype=np.int32)}
    return timed(lambda: sess.run(["y"], feeds), repetitions)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repetitions", type=int, default=20)
    ap.add_argument("--cases", default="step,forward")
    args = ap.parse_args()
    cases = args.cases.split(",")
    rows = []
    if "step" in cases:
        for kv in (8, 2):
            for rotary in (False, True):
                rows.append((f"step/kv:{kv}/rotary:{int(rotary)}/cache:4095", step_case(kv, rotary, 4095, args.repetitions)))
    if "forward" in cases:
        for kv in (8, 2):
            for rotary in (False, True):
                rows.append((f"forward/kv:{kv}/rotary:{int(rotary)}/N:4096",
                             forward_case(kv, rotary, 4096, max(3, args.repetitions // 4))))
    for name, (lo, med) in rows:
        print(json.dumps({"case": name, "ort": ort.__version__, "min_ms": round(lo, 4), "median_ms": round(med, 4),
                          "onnx": onnx.__version__}))


if __name__ == "__main__":
    main()
