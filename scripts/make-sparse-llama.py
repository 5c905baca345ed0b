#!/usr/bin/env python3
"""Write a sparse Llama-style .safetensors file: a real header, a hole for the data.

usage: make-sparse-llama.py OUT [layers hidden heads kv_heads intermediate vocab]
Defaults are Llama-2-70B's shape (68,976,648,192 parameters, 138 GB of bf16).
"""
import sys

import sparse_safetensors

out = sys.argv[1]
layers, hidden, heads, kv, inter, vocab = (int(x) for x in (sys.argv[2:] or [80, 8192, 64, 8, 28672, 32000]))
kvd = kv * hidden // heads
tensors = [("model.embed_tokens.weight", [vocab, hidden])]
for l in range(layers):
    p = f"model.layers.{l}."
    tensors += [(p + "input_layernorm.weight", [hidden]),
                (p + "self_attn.q_proj.weight", [hidden, hidden]),
                (p + "self_attn.k_proj.weight", [kvd, hidden]),
                (p + "self_attn.v_proj.weight", [kvd, hidden]),
                (p + "self_attn.o_proj.weight", [hidden, hidden]),
                (p + "post_attention_layernorm.weight", [hidden]),
                (p + "mlp.gate_proj.weight", [inter, hidden]),
                (p + "mlp.up_proj.weight", [inter, hidden]),
                (p + "mlp.down_proj.weight", [hidden, inter])]
tensors += [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]
params, offset = sparse_safetensors.write(out, tensors, "BF16")
print(f"{out}: {params:,} parameters, {offset / 1e9:.1f} GB sparse")
