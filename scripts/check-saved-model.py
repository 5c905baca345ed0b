"""Checks a directory written by `oomfix train --save DIR` as other tools read it.

1. With `safetensors` and `config.json` alone: model.safetensors carries
   {"format": "pt"}, its dtype is the config's `torch_dtype`, and its tensor
   names and shapes are exactly those the config's architecture has (GPT-2,
   Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 text, BERT
   masked-LM; Hub names, a tied
   head stored once).
2. When `transformers` (and torch) can be imported: AutoModelForCausalLM (or
   AutoModelForMaskedLM) .from_pretrained(DIR) loads it with no missing,
   unexpected or mismatched keys, and every parameter equals the file's
   tensor; the loss on fixed tokens is printed. With `--logits FILE` (a
   safetensors file of `input_ids` [b, s] and the f32 `logits` [b, s, V]
   oomfix computed from DIR), transformers' logits on those ids must equal
   them within 1e-4 of the largest logit (an fp32 directory).

Usage: python scripts/check-saved-model.py DIR [--logits FILE]
       (exit 0: every check passed)
"""

import json
import os
import sys

from safetensors import safe_open

TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def expected_tensors(c):
    """{name: shape} of the architecture `c` (a config.json) describes."""
    t = {}
    kind = c["model_type"]
    if kind == "gpt2":
        h, v, p = c["n_embd"], c["vocab_size"], c["n_positions"]
        i = c.get("n_inner") or 4 * h
        t["wte.weight"] = [v, h]
        t["wpe.weight"] = [p, h]
        for l in range(c["n_layer"]):
            b = f"h.{l}."
            for ln in ("ln_1", "ln_2"):
                t[b + ln + ".weight"] = [h]
                t[b + ln + ".bias"] = [h]
            t[b + "attn.c_attn.weight"] = [h, 3 * h]
            t[b + "attn.c_attn.bias"] = [3 * h]
            t[b + "attn.c_proj.weight"] = [h, h]
            t[b + "attn.c_proj.bias"] = [h]
            t[b + "mlp.c_fc.weight"] = [h, i]
            t[b + "mlp.c_fc.bias"] = [i]
            t[b + "mlp.c_proj.weight"] = [i, h]
            t[b + "mlp.c_proj.bias"] = [h]
        t["ln_f.weight"] = [h]
        t["ln_f.bias"] = [h]
    elif kind in ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3_text"):
        h, v, i = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        d = c.get("head_dim") or h // heads
        qkv_bias = kind == "qwen2" or c.get("attention_bias", False)
        t["model.embed_tokens.weight"] = [v, h]
        for l in range(c["num_hidden_layers"]):
            b = f"model.layers.{l}."
            t[b + "input_layernorm.weight"] = [h]
            t[b + "post_attention_layernorm.weight"] = [h]
            if kind.startswith("gemma"):
                t[b + "pre_feedforward_layernorm.weight"] = [h]
                t[b + "post_feedforward_layernorm.weight"] = [h]
            if kind == "phi3":  # fused: rows q, k, v
                t[b + "self_attn.qkv_proj.weight"] = [(heads + 2 * kv) * d, h]
            else:
                t[b + "self_attn.q_proj.weight"] = [heads * d, h]
                t[b + "self_attn.k_proj.weight"] = [kv * d, h]
                t[b + "self_attn.v_proj.weight"] = [kv * d, h]
            t[b + "self_attn.o_proj.weight"] = [h, heads * d]
            if kind in ("qwen3", "gemma3_text"):
                t[b + "self_attn.q_norm.weight"] = [d]
                t[b + "self_attn.k_norm.weight"] = [d]
            if qkv_bias:
                t[b + "self_attn.q_proj.bias"] = [heads * d]
                t[b + "self_attn.k_proj.bias"] = [kv * d]
                t[b + "self_attn.v_proj.bias"] = [kv * d]
            if c.get("attention_bias", False):
                t[b + "self_attn.o_proj.bias"] = [h]
            mlp = (("gate_up_proj", [2 * i, h]),) if kind == "phi3" else (
                ("gate_proj", [i, h]), ("up_proj", [i, h]))
            for m, shape in mlp + (("down_proj", [h, i]),):
                t[b + f"mlp.{m}.weight"] = shape
                if c.get("mlp_bias", False):
                    t[b + f"mlp.{m}.bias"] = [shape[0]]
        t["model.norm.weight"] = [h]
        if not c.get("tie_word_embeddings", kind not in ("llama", "mistral", "phi3")):
            t["lm_head.weight"] = [v, h]
    elif kind == "bert":
        h, v, i = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
        e = "bert.embeddings."
        t[e + "word_embeddings.weight"] = [v, h]
        t[e + "position_embeddings.weight"] = [c["max_position_embeddings"], h]
        t[e + "token_type_embeddings.weight"] = [c.get("type_vocab_size", 2), h]
        t[e + "LayerNorm.weight"] = [h]
        t[e + "LayerNorm.bias"] = [h]
        for l in range(c["num_hidden_layers"]):
            b = f"bert.encoder.layer.{l}."
            for m in ("query", "key", "value"):
                t[b + f"attention.self.{m}.weight"] = [h, h]
                t[b + f"attention.self.{m}.bias"] = [h]
            t[b + "attention.output.dense.weight"] = [h, h]
            t[b + "attention.output.dense.bias"] = [h]
            t[b + "attention.output.LayerNorm.weight"] = [h]
            t[b + "attention.output.LayerNorm.bias"] = [h]
            t[b + "intermediate.dense.weight"] = [i, h]
            t[b + "intermediate.dense.bias"] = [i]
            t[b + "output.dense.weight"] = [h, i]
            t[b + "output.dense.bias"] = [h]
            t[b + "output.LayerNorm.weight"] = [h]
            t[b + "output.LayerNorm.bias"] = [h]
        c_ = "cls.predictions."
        t[c_ + "transform.dense.weight"] = [h, h]
        t[c_ + "transform.dense.bias"] = [h]
        t[c_ + "transform.LayerNorm.weight"] = [h]
        t[c_ + "transform.LayerNorm.bias"] = [h]
        t[c_ + "bias"] = [v]
    else:
        raise SystemExit(f"config.json: model_type {kind!r} is not one this script knows")
    return t


def check_files(d):
    """Check 1; gives back the config."""
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    path = os.path.join(d, "model.safetensors")
    with safe_open(path, "np") as f:
        meta = f.metadata() or {}
        names = set(f.keys())
        found = {}
        for n in names:
            s = f.get_slice(n)
            found[n] = (list(s.get_shape()), s.get_dtype())
    problems = []
    if meta.get("format") != "pt":
        problems.append(f"metadata format is {meta.get('format')!r}, not 'pt'")
    want = expected_tensors(config)
    missing = sorted(set(want) - names)
    extra = sorted(names - set(want))
    if missing:
        problems.append(f"missing tensors: {missing}")
    if extra:
        problems.append(f"tensors the architecture does not have: {extra}")
    for n in sorted(set(want) & names):
        if found[n][0] != want[n]:
            problems.append(f"{n}: shape {found[n][0]}, the config says {want[n]}")
    dtype = TORCH_DTYPES.get(config.get("torch_dtype"))
    dtypes = sorted({d for _, d in found.values()})
    if dtype is None or dtypes != [dtype]:
        problems.append(f"tensor dtypes {dtypes}, config torch_dtype {config.get('torch_dtype')!r}")
    print(f"safetensors: {len(names)} tensors, {'/'.join(dtypes)}, "
          f"{config['model_type']} ({config['architectures'][0]}): "
          + ("names and shapes match the config" if not problems else "MISMATCH"))
    for p in problems:
        print("  " + p)
    return config, not problems


def check_transformers(d, config, logits_file):
    try:
        import torch
        import transformers
        from safetensors.torch import load_file
    except ImportError as e:
        print(f"transformers: not checked ({e})")
        return True
    arch = config["architectures"][0]
    auto = (transformers.AutoModelForMaskedLM if arch.endswith("MaskedLM")
            else transformers.AutoModelForCausalLM)
    model, info = auto.from_pretrained(d, output_loading_info=True)
    model.eval()
    ok = True
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(key):
            print(f"  {key}: {info[key]}")
            ok = False
    file = load_file(os.path.join(d, "model.safetensors"))
    state = model.state_dict()
    prefix = model.base_model_prefix + "."
    unequal = []
    for name, t in file.items():
        key = name if name in state else prefix + name
        if key not in state or not torch.equal(state[key], t):
            unequal.append(name)
    if unequal:
        print(f"  parameters not equal to the file: {unequal}")
        ok = False
    torch.manual_seed(0)
    vocab = config["vocab_size"]
    ids = torch.randint(0, vocab, (2, 8))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    print(f"transformers {transformers.__version__}: {type(model).__name__}.from_pretrained: "
          f"{len(file)} tensors, "
          + ("no missing/unexpected keys, every weight equal to the file"
             if ok else "FAILED")
          + f"; loss on fixed tokens {out.loss.item():.6f}")
    if logits_file:
        ref = load_file(logits_file)
        with torch.no_grad():
            got = model(input_ids=ref["input_ids"].long()).logits.float()
        want = ref["logits"].float()
        if got.shape != want.shape:
            print(f"  logits: shape {list(got.shape)}, oomfix's {list(want.shape)}")
            return False
        rel = ((got - want).abs().max() / want.abs().max()).item()
        same = rel <= 1e-4
        print(f"logits on {list(ref['input_ids'].shape)} ids: largest difference {rel:.2e} "
              f"of the largest logit: " + ("equal to oomfix's" if same else "DIFFERENT from oomfix's"))
        ok = ok and same
    return ok


def main():
    args = sys.argv[1:]
    logits_file = None
    if len(args) == 3 and args[1] == "--logits":
        logits_file = args[2]
        args = args[:1]
    if len(args) != 1:
        raise SystemExit(__doc__)
    d = args[0]
    config, ok = check_files(d)
    ok = check_transformers(d, config, logits_file) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
