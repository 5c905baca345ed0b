#!/usr/bin/env python3
"""Write a sparse GPT-2-style .safetensors file: a real header, a hole for the data.

usage: make-sparse-gpt2.py OUT [layers hidden]
Defaults are GPT-2 medium's shape (24 layers, hidden 1024: 354,823,168
parameters, 1.4 GB of fp32). Names as on the Hub (no prefix, Conv1D weights
[in, out], vocab 50257, 1024 positions, MLP 4x, head tied to wte).
"""
import sys

import sparse_safetensors

out = sys.argv[1]
layers, hidden = (int(x) for x in (sys.argv[2:] or [24, 1024]))
vocab, positions, inner = 50257, 1024, 4 * hidden
tensors = [("wte.weight", [vocab, hidden]), ("wpe.weight", [positions, hidden])]
for l in range(layers):
    p = f"h.{l}."
    tensors += [(p + "ln_1.weight", [hidden]), (p + "ln_1.bias", [hidden]),
                (p + "attn.c_attn.weight", [hidden, 3 * hidden]), (p + "attn.c_attn.bias", [3 * hidden]),
                (p + "attn.c_proj.weight", [hidden, hidden]), (p + "attn.c_proj.bias", [hidden]),
                (p + "ln_2.weight", [hidden]), (p + "ln_2.bias", [hidden]),
                (p + "mlp.c_fc.weight", [hidden, inner]), (p + "mlp.c_fc.bias", [inner]),
                (p + "mlp.c_proj.weight", [inner, hidden]), (p + "mlp.c_proj.bias", [hidden])]
tensors += [("ln_f.weight", [hidden]), ("ln_f.bias", [hidden])]
params, offset = sparse_safetensors.write(out, tensors, "F32")
print(f"{out}: {params:,} parameters, {offset / 1e9:.1f} GB sparse")
