#!/usr/bin/env python3
"""A header-only checkpoint in the shape of a Hub model, for planning,
`--verify` and step timing without downloading weights.

Writes DIR/config.json (the Hub file's values) and DIR/model.safetensors:
the tensor names and shapes of the model transformers builds from that
config (on the meta device, so nothing is allocated; a tied output
embedding is left out and a mixture of experts' weights are split per
expert, as the Hub files store them), all bf16, with a data
region that is a hole in the file (it reads as zeros and takes no disk).
Prints one JSON line: the model, its directory, transformers' parameter
count and the number of tensors.

Usage: make-hub-shape.py NAME DIR [--set KEY=JSON ...]
  NAME   one of the shapes below (`--list` prints them)
  --set  overrides a config value (e.g. --set num_hidden_layers=2), to
         make a smaller model of the family

Needs torch and transformers (no network: the configs are written here).
"""
import argparse
import json
import os
import sys

import sparse_safetensors

# meta-llama/Meta-Llama-3-8B's config.json.
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}

# The values of each model's config.json on the Hub.
SHAPES = {
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None,
        "attention_bias": False, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    "llama-3-8b": LLAMA_3_8B,
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B: Llama 3 8B with llama3 RoPE scaling
        LLAMA_3_8B, max_position_embeddings=131072,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        attention_bias=False, mlp_bias=False),
    "gemma-3-1b": {  # google/gemma-3-1b-pt
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "attention_bias": False, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    "gemma-2-2b": {  # google/gemma-2-2b
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "attention_bias": False,
        "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "float32",
    },
    "phi-3.5-mini": {  # microsoft/Phi-3.5-mini-instruct (longrope factors: 1.0 here)
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
        "sliding_window": 262144, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000,
        "torch_dtype": "bfloat16",
    },
    "phi-4-mini": {  # microsoft/Phi-4-mini-instruct (longrope factors: 1.0 here)
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
        "sliding_window": 262144, "tie_word_embeddings": True,
        "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1 (mixture of experts)
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
        "sliding_window": None, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B (mixture of experts)
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "olmoe-1b-7b": {  # allenai/OLMoE-1B-7B-0924 (mixture of experts)
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
        "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 64, "num_experts_per_tok": 8, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "clip_qkv": None, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    "tinyllama-1.1b": {  # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    },
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16",
    },
}


def tensors(config):
    """(name, shape) of every tensor of the model transformers builds, the
    tied output embedding left out, and the parameter count."""
    import torch
    import transformers

    values = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    model_type = values.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    parameters = sum(p.numel() for p in model.parameters())
    state = model.state_dict()
    tied = cfg.tie_word_embeddings
    out = []
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue
        out.append((name, list(t.shape)))
    return out, parameters


def hub_layout(model_type, entries):
    """`entries` with a mixture of experts' weights as the Hub files store
    them, one tensor per expert and projection, where transformers holds
    each block's experts fused (`mlp.experts.gate_up_proj` `[E, 2I, h]`,
    `mlp.experts.down_proj` `[E, h, I]`): Mixtral's `block_sparse_moe`
    with `w1` (gate), `w3` (up) and `w2` (down), the others' `mlp.experts.E`
    with `gate_proj`, `up_proj` and `down_proj`."""
    out = []
    for name, shape in entries:
        block, sep, rest = name.partition("mlp.")
        mixtral = model_type == "mixtral"
        prefix = block + ("block_sparse_moe." if mixtral else "mlp.")
        if sep and rest == "gate.weight" and mixtral:
            out.append((prefix + "gate.weight", shape))
        elif sep and rest == "experts.gate_up_proj":
            experts, rows, h = shape
            for e in range(experts):
                gate, up = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
                out.append((f"{prefix}experts.{e}.{gate}.weight", [rows // 2, h]))
                out.append((f"{prefix}experts.{e}.{up}.weight", [rows // 2, h]))
        elif sep and rest == "experts.down_proj":
            experts, h, inner = shape
            for e in range(experts):
                down = "w2" if mixtral else "down_proj"
                out.append((f"{prefix}experts.{e}.{down}.weight", [h, inner]))
        else:
            out.append((name, shape))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("dir", nargs="?")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = parser.parse_args()
    if args.list:
        print("\n".join(sorted(SHAPES)))
        return 0
    if not args.name or not args.dir:
        parser.error("NAME and DIR are required")
    config = dict(SHAPES[args.name])
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item}: expected KEY=JSON")
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError as e:
            parser.error(f"--set {item}: {e}")
    entries, parameters = tensors(config)
    entries = hub_layout(config["model_type"], entries)
    os.makedirs(args.dir, exist_ok=True)
    sparse_safetensors.write(os.path.join(args.dir, "model.safetensors"), entries)
    tmp = os.path.join(args.dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, os.path.join(args.dir, "config.json"))
    print(json.dumps({"model": args.name, "dir": args.dir, "parameters": parameters,
                      "tensors": len(entries)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
