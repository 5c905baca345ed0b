#!/usr/bin/env python3
"""Write the fuzz seed corpus and the index target's shards.

usage: python3 fuzz/seeds.py   (from anywhere; writes under fuzz/)

corpus/header/: whole .safetensors files (data region included, zeros) of tiny
GPT-2, Llama-style and BERT models and an unknown architecture.
models/: the files the other targets' inputs sit next to: the two shards of a
tiny Llama-style model (index target) and one model per family (config target).
corpus/index/: indexes over the shards, valid and not.
corpus/config/: a model-selecting byte, then a config.json.
"""
import json, os, struct

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1}


def safetensors(tensors, metadata=True):
    """A whole file for [(name, dtype, shape)], laid out contiguously in order."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        n = SIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + bytes(offset)


def gpt2(layers=2, h=4, vocab=16, pos=8, prefix="", dtype="F16"):
    t = [(prefix + "wte.weight", dtype, [vocab, h]), (prefix + "wpe.weight", dtype, [pos, h])]
    for l in range(layers):
        p = f"{prefix}h.{l}."
        t += [(p + "ln_1.weight", dtype, [h]), (p + "ln_1.bias", dtype, [h]),
              (p + "attn.bias", dtype, [1, 1, pos, pos]),
              (p + "attn.c_attn.weight", dtype, [h, 3 * h]), (p + "attn.c_attn.bias", dtype, [3 * h]),
              (p + "attn.c_proj.weight", dtype, [h, h]), (p + "attn.c_proj.bias", dtype, [h]),
              (p + "ln_2.weight", dtype, [h]), (p + "ln_2.bias", dtype, [h]),
              (p + "mlp.c_fc.weight", dtype, [h, 4 * h]), (p + "mlp.c_fc.bias", dtype, [4 * h]),
              (p + "mlp.c_proj.weight", dtype, [4 * h, h]), (p + "mlp.c_proj.bias", dtype, [h])]
    return t + [(prefix + "ln_f.weight", dtype, [h]), (prefix + "ln_f.bias", dtype, [h])]


def llama_layer(l, h=8, kv=4, inter=16, dtype="BF16", qkv_bias=False):
    p = f"model.layers.{l}."
    t = [(p + "input_layernorm.weight", dtype, [h]),
         (p + "self_attn.q_proj.weight", dtype, [h, h]),
         (p + "self_attn.k_proj.weight", dtype, [kv, h]),
         (p + "self_attn.v_proj.weight", dtype, [kv, h])]
    if qkv_bias:
        t += [(p + "self_attn.q_proj.bias", dtype, [h]), (p + "self_attn.k_proj.bias", dtype, [kv]),
              (p + "self_attn.v_proj.bias", dtype, [kv])]
    return t + [(p + "self_attn.o_proj.weight", dtype, [h, h]),
                (p + "post_attention_layernorm.weight", dtype, [h]),
                (p + "mlp.gate_proj.weight", dtype, [inter, h]),
                (p + "mlp.up_proj.weight", dtype, [inter, h]),
                (p + "mlp.down_proj.weight", dtype, [h, inter]),
                (p + "self_attn.rotary_emb.inv_freq", "F32", [2])]


def llama(layers=2, vocab=16, h=8, tied=False, **kw):
    t = [("model.embed_tokens.weight", "BF16", [vocab, h])]
    for l in range(layers):
        t += llama_layer(l, h=h, **kw)
    t += [("model.norm.weight", "BF16", [h])]
    return t if tied else t + [("lm_head.weight", "BF16", [vocab, h])]


def bert(layers=2, h=4, vocab=16, pos=8, prefix="bert.", head=True):
    e = prefix + "embeddings."
    t = [(e + "word_embeddings.weight", "F32", [vocab, h]), (e + "position_embeddings.weight", "F32", [pos, h]),
         (e + "token_type_embeddings.weight", "F32", [2, h]), (e + "LayerNorm.weight", "F32", [h]),
         (e + "LayerNorm.bias", "F32", [h]), (e + "position_ids", "I64", [1, pos])]
    for l in range(layers):
        p = f"{prefix}encoder.layer.{l}."
        for m in ["query", "key", "value"]:
            t += [(p + f"attention.self.{m}.weight", "F32", [h, h]), (p + f"attention.self.{m}.bias", "F32", [h])]
        t += [(p + "attention.output.dense.weight", "F32", [h, h]), (p + "attention.output.dense.bias", "F32", [h]),
              (p + "attention.output.LayerNorm.weight", "F32", [h]), (p + "attention.output.LayerNorm.bias", "F32", [h]),
              (p + "intermediate.dense.weight", "F32", [4 * h, h]), (p + "intermediate.dense.bias", "F32", [4 * h]),
              (p + "output.dense.weight", "F32", [h, 4 * h]), (p + "output.dense.bias", "F32", [h]),
              (p + "output.LayerNorm.weight", "F32", [h]), (p + "output.LayerNorm.bias", "F32", [h])]
    if head:
        c = "cls.predictions."
        t += [(c + "transform.dense.weight", "F32", [h, h]), (c + "transform.dense.bias", "F32", [h]),
              (c + "transform.LayerNorm.weight", "F32", [h]), (c + "transform.LayerNorm.bias", "F32", [h]),
              (c + "decoder.weight", "F32", [vocab, h]), (c + "decoder.bias", "F32", [vocab]),
              (c + "bias", "F32", [vocab])]
    return t


def write(path, data):
    path = os.path.join(HERE, path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


write("corpus/header/gpt2.safetensors", safetensors(gpt2()))
write("corpus/header/gpt2-transformer-prefix-f32.safetensors", safetensors(gpt2(layers=1, prefix="transformer.", dtype="F32")))
write("corpus/header/llama-gqa.safetensors", safetensors(llama()))
write("corpus/header/llama-tied-qkv-bias.safetensors", safetensors(llama(layers=1, tied=True, qkv_bias=True), metadata=False))
write("corpus/header/bert.safetensors", safetensors(bert()))
write("corpus/header/bert-no-prefix-no-head.safetensors", safetensors(bert(layers=1, prefix="", head=False)))
write("corpus/header/generic.safetensors", safetensors(
    [("encoder.blocks.0.w", "F16", [4, 4]), ("encoder.blocks.1.w", "F16", [4, 4]), ("mask", "U8", [3])]))
write("corpus/header/empty-header.safetensors", safetensors([], metadata=False))
# A zero-row embedding may claim any width: a hidden size whose 4x MLP overflows.
write("corpus/header/huge-hidden-empty-embedding.safetensors", safetensors(
    [("wte.weight", "F16", [0, 1 << 62]), ("h.0.attn.c_attn.weight", "F16", [1])]))

# Index target: a 2-layer Llama-style model in two shards.
first = [("model.embed_tokens.weight", "BF16", [16, 8])] + llama_layer(0)
second = llama_layer(1) + [("model.norm.weight", "BF16", [8]), ("lm_head.weight", "BF16", [16, 8])]
shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
weight_map = {}
for shard, tensors in shards.items():
    write(f"models/{shard}", safetensors(tensors))
    weight_map.update({name: shard for name, _, _ in tensors})


def index(weight_map, **extra):
    return json.dumps({"metadata": {"total_size": 1234}, **extra, "weight_map": weight_map}, indent=2).encode()


write("corpus/index/valid.json", index(weight_map))
write("corpus/index/first-shard-only.json",
      index({k: v for k, v in weight_map.items() if v.startswith("model-00001")}))
swapped = dict(weight_map, **{"model.norm.weight": "model-00001-of-00002.safetensors"})
write("corpus/index/tensor-in-wrong-shard.json", index(swapped))
write("corpus/index/missing-shard.json", index(dict(weight_map, **{"extra.weight": "model-00003-of-00003.safetensors"})))
write("corpus/index/weight-map-not-object.json", index([["model.norm.weight", "model-00002-of-00002.safetensors"]]))

# Config target: the first input byte picks models/config-<n>.safetensors, the rest is config.json.
models = [gpt2(layers=1), llama(layers=1, h=8, kv=4), bert(layers=1, head=False)]
for n, tensors in enumerate(models):
    write(f"models/config-{n}.safetensors", safetensors(tensors))
configs = [
    (0, {"model_type": "gpt2", "n_head": 2, "n_positions": 8, "n_embd": 4, "n_layer": 1, "vocab_size": 16}),
    (1, {"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
         "max_position_embeddings": 64, "hidden_size": 8, "tie_word_embeddings": False}),
    (1, {"num_attention_heads": 4, "num_key_value_heads": None}),
    (2, {"model_type": "bert", "num_attention_heads": 2, "intermediate_size": 16, "tie_word_embeddings": True}),
    (0, {"num_attention_heads": 3}),
    # Values the rules check (src/inspect/config/rules.rs), valid and not.
    (1, {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 64,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}}),
    (1, {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 64,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1}}),
    (1, {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 64,
         "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                          "original_max_position_embeddings": 4}, "partial_rotary_factor": 0.5}),
    (1, {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 64,
         "rope_parameters": {"rope_type": "linear", "factor": 0.0, "rope_theta": 10000.0},
         "sliding_window": 0, "pad_token_id": 3, "attention_dropout": 0.1}),
    (0, {"model_type": "gpt2", "n_head": 2, "n_positions": 8, "n_embd": 4, "n_layer": 1, "vocab_size": 16,
         "layer_norm_epsilon": 1e-5, "attn_pdrop": 0.1, "activation_function": "gelu_new"}),
]
for i, (n, config) in enumerate(configs):
    write(f"corpus/config/{i}.json", bytes([n]) + json.dumps(config).encode())
