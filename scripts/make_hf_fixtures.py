#!/usr/bin/env python3
"""Writes tests/fixtures/hf/<model>/: tiny Hugging Face models built from small configs with random weights
(no download), saved with save_pretrained (config.json, model.safetensors), and what transformers' own
attention blocks compute in them, for tests/hf_test.cpp, which loads the blocks with sdpa::load_hf_attention:

    llama    LlamaForCausalLM, GQA, llama3 rope scaling       mistral  MistralForCausalLM, sliding window
    qwen2    Qwen2ForCausalLM, q/k/v biases, yarn scaling     gemma2   Gemma2ForCausalLM, softcap, scale,
                                                                       sliding and full layers
    gpt_oss  GptOssForCausalLM, sinks, biases, yarn (not truncated), sliding and full layers
    gpt2     GPT2LMHeadModel (c_attn fused and transposed)     bert     BertModel (a padding mask)
    gpt2_layer_scaled, gpt2_unscaled  GPT-2 with scale_attn_by_inverse_layer_idx (and reorder_and_upcast_attn),
             and without scale_attn_weights               bert_decoder  BERT with is_decoder (causal)

For each layer: the hidden states entering its attention (after the layer norm, captured by a hook) and the
attention block's output (o_proj / c_proj / output.dense applied), on a prompt of `prompt` tokens (batch 2,
the second with padding for BERT), and the same for step-by-step decoding with transformers' DynamicCache
(decoders: the prompt, then `steps` single tokens). Saved as fixture.sdpafix (make_fixtures.py's format):
    layer<i>.prefill.input (b, n, hidden), layer<i>.prefill.output, layer<i>.step<t>.input (b, 1, hidden),
    layer<i>.step<t>.output; attention_mask (b, n) i64 for BERT; torch and transformers versions.

Run in a virtual environment with `pip install torch transformers numpy safetensors`:
    python3 scripts/make_hf_fixtures.py [model ...]
"""

import hashlib
import json
import os
import sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128)


def decoders():
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**COMMON, num_key_value_heads=2, rope_theta=10000.0,
                                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 32})),
        "mistral": (MistralForCausalLM, MistralConfig(**COMMON, num_key_value_heads=1, sliding_window=5)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, num_key_value_heads=2,
                                               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 32})),
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                                  attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                                  sliding_window=5)),
        "gpt_oss": (GptOssForCausalLM, GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                                   num_experts_per_tok=1, sliding_window=5,
                                                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                                 "beta_slow": 1.0, "truncate": False,
                                                                 "original_max_position_embeddings": 32})),
    }


def new_decoders():
    """The blocks of issue 48: QK-norm (per head, whole projection, 1 + w, Llama 4's weightless one after
    the rotary), the output gate, chunked and NoPE layers with temperature tuning, a rotary per layer kind."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, Llama4ForCausalLM, Llama4TextConfig, Olmo2Config,
                              Olmo2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM)
    from transformers import Phi3Config, Phi3ForCausalLM
    common = dict(COMMON)
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
    mla = dict(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, n_routed_experts=2,
               n_shared_experts=1, num_experts_per_tok=1, first_k_dense_replace=2, kv_lora_rank=16, qk_rope_head_dim=8,
               qk_nope_head_dim=12, v_head_dim=10, n_group=1, topk_group=1,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0})
    return {
        # Multi-head latent attention: query compression on (q_lora_rank 24) and off; v_head_dim != nope;
        # YaRN whose mscale_all_dim scales the softmax.
        "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(**mla, q_lora_rank=24)),
        "deepseek_v3_no_q_lora": (DeepseekV3ForCausalLM, DeepseekV3Config(**mla, q_lora_rank=None)),
        "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config(**dict(mla, first_k_dense_replace=2), q_lora_rank=24)),
        # LongRoPE on 12 of 16 features (partial_rotary_factor 0.75), pretrained length 8: the prompt of 7
        # rotates short, the steps from position 8 on long (the prompt's cached keys stay short).
        "phi3": (Phi3ForCausalLM, Phi3Config(**common, num_key_value_heads=2, original_max_position_embeddings=8,
                                            partial_rotary_factor=0.75, pad_token_id=0,
                                            rope_scaling={"rope_type": "longrope",
                                                          "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                          "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]})),
        # 6 heads of 16 in a hidden size of 64 (head_dim != hidden / heads), GQA groups of 3.
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**dict(common, num_attention_heads=6), num_key_value_heads=2, head_dim=16,
                                               rope_scaling={"rope_type": "linear", "factor": 2.0})),
        "olmo2": (Olmo2ForCausalLM, Olmo2Config(**common, num_key_value_heads=2,
                                               rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 16})),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                                      sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                                                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                          "rope_theta": 10000.0},
                                                                       "sliding_attention": {"rope_type": "default",
                                                                                             "rope_theta": 500.0}},
                                                      final_logit_softcapping=None)),
        "qwen3_next": (Qwen3NextForCausalLM, Qwen3NextConfig(
            **common, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=2, num_experts=2,
            num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
        # Layer 0 chunked (chunks of 4) with the L2 norm after its interleaved rotary; layer 1 NoPE with
        # temperature tuning (floor_scale 2, so that it changes within the prompt).
        "llama4_text": (Llama4ForCausalLM, Llama4TextConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size_mlp=64, num_local_experts=2,
            num_experts_per_tok=1, no_rope_layers=[1, 0], attention_chunk_size=4, attn_temperature_tuning=True,
            floor_scale=2, attn_scale=0.25, use_qk_norm=True,
            rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32, "rope_theta": 10000.0})),
    }


def capture_gradients(model, ids, seed):
    """Per attention block, autograd's gradients of sum(output * R) (R random, of the output's shape) with
    respect to its input and its parameters, on a prefill of ids."""
    seen = {}
    hooks = []
    for name, m in attention_modules(model):
        def pre(mod, args, kwargs, name=name):
            if "hidden_states" in kwargs:
                kwargs = dict(kwargs)
                kwargs["hidden_states"] = kwargs["hidden_states"].detach().requires_grad_()
                seen[name] = {"x": kwargs["hidden_states"]}
                return args, kwargs
            x = args[0].detach().requires_grad_()
            seen[name] = {"x": x}
            return (x,) + tuple(args[1:]), kwargs

        def post(mod, args, kwargs, out, name=name):
            seen[name]["y"] = out[0]
        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.enable_grad():
            model(ids, use_cache=False)
            out = {}
            g = torch.Generator().manual_seed(seed)
            for name, m in attention_modules(model):
                x, y = seen[name]["x"], seen[name]["y"]
                r = torch.randn(y.shape, generator=g, dtype=y.dtype)
                params = dict(m.named_parameters())
                keys = sorted(params)
                grads = torch.autograd.grad((y * r).sum(), [x] + [params[k] for k in keys])
                out[name] = {"seed_output": r, "input": grads[0]}
                out[name].update({k: gr for k, gr in zip(keys, grads[1:])})
    finally:
        for h in hooks:
            h.remove()
    return out


def make_bf16(name, prompt=7, batch=2):
    """<name>_bf16: the model of <name> saved in bfloat16 (save_pretrained), and the prefill of the float32
    model with those rounded weights, for loading a bf16 checkpoint into float and double modules."""
    import transformers as tr
    src = os.path.join(OUT, name)
    config = tr.AutoConfig.from_pretrained(src)
    config._attn_implementation = "eager"
    model = tr.AutoModelForCausalLM.from_pretrained(src, config=config, torch_dtype=torch.bfloat16).eval()
    directory = os.path.join(OUT, name + "_bf16")
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    model = model.to(torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=g)
    entries = version_entries()
    with torch.no_grad():
        full = capture(model, lambda: model(ids, use_cache=False))
    names = sorted(full)
    for i, n in enumerate(names):
        entries += [(f"layer{i}.prefill.input", full[n][0]), (f"layer{i}.prefill.output", full[n][1])]
    with open(os.path.join(directory, "layers.json"), "w") as f:
        json.dump([n + "." for n in names], f)
    write_fixture(directory, entries)


def attention_modules(model):
    for name, m in model.named_modules():
        if name.endswith("self_attn") or name.endswith(".attn") or name.endswith("attention.self"):
            yield name, m


def capture(model, run):
    """Runs run() with hooks on every attention block: (input hidden states, block output) per layer."""
    seen = {}
    hooks = []
    for name, m in attention_modules(model):
        def hook(mod, args, kwargs, out, name=name):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            seen[name] = (hs.detach().double().numpy(), out[0].detach().double().numpy())
        hooks.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.1))


def write_fixture(directory, entries):
    data = mf.encode_file(entries)
    path = os.path.join(directory, "fixture.sdpafix")
    with open(path, "wb") as f:
        f.write(data)
    print(f"{hashlib.sha256(data).hexdigest()[:16]}  {os.path.relpath(path)}  ({len(data)} bytes)")


def version_entries():
    t = [int(x) for x in torch.__version__.split("+")[0].split(".")[:3]]
    tr = [int(x) for x in transformers.__version__.split(".")[:3]]
    return [("torch_version", np.int64(t[0] * 10000 + t[1] * 100 + t[2])),
            ("transformers_version", np.int64(tr[0] * 10000 + tr[1] * 100 + tr[2]))]


def make_decoder(name, cls, config, prompt=7, steps=4, batch=2, gradients=False, padded=0):
    """padded > 0: the prefill also runs with the second sequence's last `padded` tokens padded out
    (layer<i>.padded.output, attention_mask (batch, prompt))."""
    from transformers import DynamicCache
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = cls(config).eval()
    randomize(model, mf.seed_of("hf/" + name))
    directory = os.path.join(OUT, name)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, prompt + steps), generator=g)
    entries = version_entries() + [("prompt", np.int64(prompt)), ("steps", np.int64(steps))]
    with torch.no_grad():
        full = capture(model, lambda: model(ids[:, :prompt], use_cache=False))
        names = sorted(full)
        for i, n in enumerate(names):
            entries += [(f"layer{i}.prefill.input", full[n][0]), (f"layer{i}.prefill.output", full[n][1])]
        if padded:
            mask = torch.ones(batch, prompt, dtype=torch.int64)
            mask[1, prompt - padded:] = 0
            seen = capture(model, lambda: model(ids[:, :prompt], attention_mask=mask, use_cache=False))
            entries.append(("attention_mask", mask.numpy()))
            for i, n in enumerate(names):
                entries += [(f"layer{i}.padded.input", seen[n][0]), (f"layer{i}.padded.output", seen[n][1])]
        cache = DynamicCache(config=config)
        model(ids[:, :prompt], past_key_values=cache, use_cache=True)
        for t in range(steps):
            pos = prompt + t
            seen = capture(model, lambda: model(ids[:, pos:pos + 1], past_key_values=cache, use_cache=True,
                                                position_ids=torch.full((batch, 1), pos)))
            for i, n in enumerate(names):
                entries += [(f"layer{i}.step{t}.input", seen[n][0]), (f"layer{i}.step{t}.output", seen[n][1])]
    if gradients:
        for i, n in enumerate(names):
            for k, v in capture_gradients(model, ids[:, :prompt], mf.seed_of("hf/" + name + "/grad")).get(n, {}).items():
                entries.append((f"layer{i}.grad.{k}", v.detach().double().numpy()))
    entries.append(("layer_prefixes", np.array([len(n) for n in names], dtype=np.int64)))
    with open(os.path.join(directory, "layers.json"), "w") as f:
        json.dump([n + "." for n in names], f)
    write_fixture(directory, entries)


def make_qwen2_vl(prompt=7, steps=4, batch=2):
    """Qwen2-VL's text model with multimodal rotary positions (t, h, w) per token: batch entry 0 holds two text
    tokens, a 2 x 2 image (one t, its rows and columns in h and w) and text again, entry 1 text only; the
    steps are text. Saves the positions as `positions` (3, batch, prompt + steps)."""
    from transformers import DynamicCache, Qwen2VLTextConfig, Qwen2VLTextModel
    name = "qwen2_vl"
    config = Qwen2VLTextConfig(**COMMON, num_key_value_heads=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen2VLTextModel(config).eval()
    randomize(model, mf.seed_of("hf/" + name))
    directory = os.path.join(OUT, name)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    n = prompt + steps
    pos = torch.zeros(3, batch, n, dtype=torch.int64)
    image = [(2, 2, 2), (2, 2, 3), (2, 3, 2), (2, 3, 3)]
    row0 = [(0, 0, 0), (1, 1, 1)] + image + [(4 + i, 4 + i, 4 + i) for i in range(n - 6)]
    for t, p in enumerate(row0):
        pos[:, 0, t] = torch.tensor(p)
    pos[:, 1, :] = torch.arange(n)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, n), generator=g)
    entries = version_entries() + [("prompt", np.int64(prompt)), ("steps", np.int64(steps)), ("positions", pos.numpy())]
    with torch.no_grad():
        full = capture(model, lambda: model(ids[:, :prompt], position_ids=pos[:, :, :prompt], use_cache=False))
        names = sorted(full)
        for i, nm in enumerate(names):
            entries += [(f"layer{i}.prefill.input", full[nm][0]), (f"layer{i}.prefill.output", full[nm][1])]
        cache = DynamicCache(config=config)
        model(ids[:, :prompt], position_ids=pos[:, :, :prompt], past_key_values=cache, use_cache=True)
        for t in range(steps):
            at = prompt + t
            seen = capture(model, lambda: model(ids[:, at:at + 1], position_ids=pos[:, :, at:at + 1], past_key_values=cache,
                                                use_cache=True))
            for i, nm in enumerate(names):
                entries += [(f"layer{i}.step{t}.input", seen[nm][0]), (f"layer{i}.step{t}.output", seen[nm][1])]
    with open(os.path.join(directory, "layers.json"), "w") as f:
        json.dump([nm + "." for nm in names], f)
    write_fixture(directory, entries)


def make_gpt2(name="gpt2", **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0,
                        **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    randomize(model, mf.seed_of("hf/" + name))
    directory = os.path.join(OUT, name)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    entries = version_entries()
    with torch.no_grad():
        seen = capture(model, lambda: model(ids, use_cache=False))
    names = sorted(seen)
    for i, n in enumerate(names):
        entries += [(f"layer{i}.prefill.input", seen[n][0]), (f"layer{i}.prefill.output", seen[n][1])]
    with open(os.path.join(directory, "layers.json"), "w") as f:
        json.dump([n + "." for n in names], f)
    write_fixture(directory, entries)


def make_bert(name="bert", **overrides):
    from transformers import BertConfig, BertModel
    config = BertConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=64, intermediate_size=64,
                        max_position_embeddings=64, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False).eval()
    randomize(model, mf.seed_of("hf/" + name))
    directory = os.path.join(OUT, name)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 5:] = 0  # the second sentence is padded
    entries = version_entries() + [("attention_mask", mask.numpy())]
    seen = {}
    hooks = []
    for name, m in model.named_modules():
        if name.endswith("attention"):  # BertAttention: self-attention + output (dense, dropout, LayerNorm)
            def hook_self(mod, args, kwargs, out, name=name):
                seen[name + ".in"] = kwargs.get("hidden_states", args[0] if args else None).detach().double().numpy()
            def hook_dense(mod, args, out, name=name):
                seen[name + ".out"] = out.detach().double().numpy()  # BertSelfOutput.dense, before dropout and norm
            hooks.append(m.self.register_forward_hook(hook_self, with_kwargs=True))
            hooks.append(m.output.dense.register_forward_hook(hook_dense))
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    names = sorted({k.rsplit(".", 1)[0] for k in seen})
    for i, n in enumerate(names):
        entries += [(f"layer{i}.prefill.input", seen[n + ".in"]), (f"layer{i}.prefill.output", seen[n + ".out"])]
    with open(os.path.join(directory, "layers.json"), "w") as f:
        json.dump([n + "." for n in names], f)
    write_fixture(directory, entries)


def main():
    """Every model, or those named on the command line."""
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    wanted = set(sys.argv[1:])
    def want(name):
        return not wanted or name in wanted
    for name, (cls, config) in decoders().items():
        if want(name):
            make_decoder(name, cls, config)
    for name, (cls, config) in new_decoders().items():
        if want(name):
            make_decoder(name, cls, config, gradients=True, padded=3 if name == "qwen3" else 0)
    for name in ("qwen3", "deepseek_v3"):
        if want(name + "_bf16"):
            make_bf16(name)
    if want("qwen2_vl"):
        make_qwen2_vl()
    if want("gpt2"):
        make_gpt2()
    if want("gpt2_layer_scaled"):  # scores divided by layer + 1 too, through the upcast and reordered product
        make_gpt2("gpt2_layer_scaled", scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)
    if want("gpt2_unscaled"):
        make_gpt2("gpt2_unscaled", scale_attn_weights=False)
    if want("bert"):
        make_bert()
    if want("bert_decoder"):  # is_decoder: causal self-attention
        make_bert("bert_decoder", is_decoder=True)


if __name__ == "__main__":
    main()
