#!/usr/bin/env python3
"""Writes tests/fixtures/rope/*.sdpafix: the inverse frequencies and attention factor that Hugging Face's
transformers computes for each rope_type sdpa implements (default, linear, llama3, yarn), from its own
ROPE_INIT_FUNCTIONS, so that tests/rotary_test.cpp checks sdpa::rope_* against them.

Run in a virtual environment with `pip install torch transformers numpy` (no download of any model):
python3 scripts/make_rope_fixtures.py. Each file: rope_type (i64: 0 default, 1 linear, 2 llama3, 3 yarn),
dim, theta, factor, low_freq_factor, high_freq_factor, original_max_positions, inv_freq (dim / 2, f64 of
transformers' float32 values), attention_factor.
"""

import hashlib
import os
import sys

import numpy as np
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

CASES = {
    "default_128": dict(rope_type="default", dim=128, theta=10000.0),
    "default_64_500k": dict(rope_type="default", dim=64, theta=500000.0),
    "linear_64": dict(rope_type="linear", dim=64, theta=10000.0, factor=4.0),
    "llama3_128": dict(rope_type="llama3", dim=128, theta=500000.0, factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_positions=8192),
    "llama3_64_small": dict(rope_type="llama3", dim=64, theta=10000.0, factor=4.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_positions=256),
    "yarn_128": dict(rope_type="yarn", dim=128, theta=1000000.0, factor=4.0, original_max_positions=32768),
    "yarn_64": dict(rope_type="yarn", dim=64, theta=10000.0, factor=8.0, original_max_positions=4096),
}
TYPES = {"default": 0, "linear": 1, "llama3": 2, "yarn": 3}


def compute(case):
    heads = 4
    scaling = None
    if case["rope_type"] != "default":
        scaling = {"rope_type": case["rope_type"], "factor": case["factor"]}
        if case["rope_type"] == "llama3":
            scaling.update(low_freq_factor=case["low_freq_factor"], high_freq_factor=case["high_freq_factor"],
                           original_max_position_embeddings=case["original_max_positions"])
        if case["rope_type"] == "yarn":
            scaling.update(original_max_position_embeddings=case["original_max_positions"])
    config = LlamaConfig(hidden_size=case["dim"] * heads, num_attention_heads=heads, rope_theta=case["theta"],
                         rope_scaling=scaling,
                         max_position_embeddings=case.get("original_max_positions", 2048) * int(case.get("factor", 1)))
    if case["rope_type"] == "default":  # (transformers 5 keeps the default on the model's rotary class)
        inv_freq, attention_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[case["rope_type"]](config, "cpu")
    return inv_freq.double().numpy(), float(attention_factor)


def main():
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "rope")
    os.makedirs(out_dir, exist_ok=True)
    for name, case in CASES.items():
        inv_freq, attention_factor = compute(case)
        entries = [("rope_type", np.int64(TYPES[case["rope_type"]])), ("dim", np.int64(case["dim"])),
                   ("theta", np.float64(case["theta"])), ("factor", np.float64(case.get("factor", 1.0))),
                   ("low_freq_factor", np.float64(case.get("low_freq_factor", 0.0))),
                   ("high_freq_factor", np.float64(case.get("high_freq_factor", 0.0))),
                   ("original_max_positions", np.int64(case.get("original_max_positions", 0))),
                   ("inv_freq", inv_freq), ("attention_factor", np.float64(attention_factor))]
        data = mf.encode_file(entries)
        path = os.path.join(out_dir, name + ".sdpafix")
        with open(path, "wb") as f:
            f.write(data)
        print(f"{hashlib.sha256(data).hexdigest()[:16]}  {os.path.relpath(path)}  ({len(data)} bytes)")


if __name__ == "__main__":
    main()
