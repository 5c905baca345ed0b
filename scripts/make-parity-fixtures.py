#!/usr/bin/env python3
"""Reference values from Hugging Face transformers for oomfix's parity tests.

Writes, under tests/fixtures (or the directory given), from fixed seeds:

train/<name>/model.safetensors, train/<name>/config.json
    Tiny models with random weights, biases and norm scales, as save_pretrained
    writes them: GPT-2; Llama with grouped-query attention and an untied head;
    Qwen2 with q/k/v biases and a tied head; BERT masked-LM; then, with norm
    scales drawn from N(1, 0.5): Qwen3 (q/k norms, head size 16 where
    hidden / heads is 8); a Llama 3.2-style model (llama3 RoPE scaling, base
    500000, head size 16); Llamas with linear, dynamic (NTK; the batch longer
    than the context) and yarn RoPE scaling; Phi-3 (fused projections);
    Phi-3.5-style (longrope, short factors) and Phi-4-mini-style (partial
    rotary, longrope past the original context);
    Gemma 2 (soft-capping, sliding windows) and Gemma 3 text (q/k norms,
    local and global RoPE bases, sliding windows), their norm weights (scales
    1 + w) drawn from N(0, 0.5).
train/<name>.ref.safetensors
    input_ids, targets, loss_mask (BERT: and attention_mask, the second
    sequence ending with 3 padding tokens), the logits (f32 [b, s, V]), the
    loss and the gradient of every parameter (grad.<Hub name>). The loss is
    the mean cross-entropy over the positions loss_mask selects, computed on
    the logits in float32, as oomfix's models define it. The scaled-RoPE and
    Qwen3 fixtures add rope.inv_freq and rope.attention_scaling (f64), the
    rotary embedding's after the forward pass.
train/<name>.bf16.safetensors
    The logits, loss and gradients (stored as f32) of the same model and
    batch computed in bfloat16: how far a 16-bit step lands from the f32
    values by itself.
    Used by tests/train_models.rs.

train/<name>.lora.safetensors, train/<name>.lora.bf16.safetensors
    For gpt2, llama, qwen2, qwen3 and phi3 (their model files as above):
    PEFT LoRA adapters (r 4, lora_alpha 8, all-linear, no dropout) with A
    and B drawn from N(0, 0.2²) rather than PEFT's initialisation (B = 0
    would give A no gradient), as `lora.<PEFT name>` (PEFT's saved names);
    on the batch of <name>.ref.safetensors, the logits, the loss and each
    adapter's gradient (`grad.<PEFT name>`), in float32 and (the second
    file; the model and adapters rounded to bfloat16) in bfloat16, stored
    as f32. Used by tests/lora_train.rs. `--lora` writes these alone, from
    the model files already there.

finetune/
    A tiny pretrained Llama-style model (tied embeddings, RoPE base 100000)
    beside a byte-level BPE tokenizer.json trained on finetune/train.txt, its
    vocabulary the model's; the model is "pretrained" by a few hundred seeded
    AdamW steps on train.txt. train.txt (training text) and eval.txt
    (held-out text) are written by hand and only read here.
    finetune/reference.json holds the first training micro-batch as oomfix
    builds it from train.txt (tokenized line by line with line breaks, the
    end-of-text id after the document, windows of seq_len + 1 tokens read in
    order, each starting seq_len after the previous) and the loss transformers
    computes on it (model(input_ids=window, labels=window).loss).
    Used by tests/finetune_cli.rs.

Runs on PyTorch CPU with transformers, tokenizers and safetensors from PyPI
(written with torch 2.15, transformers 5.25, tokenizers 0.23, safetensors
0.8). Every run with the same versions on the same machine writes the same
files; on another CPU the reference values may differ in their last bits
(the first four models' gradients by up to 9e-7 of their largest element;
the model files themselves are the same).

Usage: python scripts/make-parity-fixtures.py [--lora] [FIXTURES_DIR]   (default: tests/fixtures)
       ONLY=gemma2,gemma3 python scripts/make-parity-fixtures.py   (those parity fixtures only)
"""

import json
import os
import shutil
import sys

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
from transformers import (BertConfig, BertForMaskedLM, Gemma2Config, Gemma2ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

B, S, V = 2, 8, 64


def perturb(model):
    # Random values everywhere (biases and norm scales too), so that a wrong
    # convention anywhere changes the loss or a gradient.
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.08)


def spread_norms(model):
    # Norm scales far from 1 (N(1, 0.5)), so that a norm left out or applied
    # where transformers does not (Qwen3's q/k norms) changes the loss.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.5)


def rope(theta, scaling=None):
    """RoPE's config arguments: transformers 5 takes them as rope_parameters,
    4 as rope_theta and rope_scaling."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=theta)}
    return {"rope_theta": theta, "rope_scaling": scaling}


def llama_with(scaling, theta=10000.0, **kw):
    """A tiny Llama (grouped-query attention, tied head) with a RoPE scaling."""
    args = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=48, vocab_size=V,
                max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                attn_implementation="eager", **rope(theta, scaling))
    args.update(kw)
    return LlamaForCausalLM(LlamaConfig(**args))


def phi3_with(original, tied, scaling=None, **kw):
    """A tiny Phi-3 (fused projections, grouped-query attention) whose
    original context is `original` positions, with a RoPE scaling."""
    args = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=48, vocab_size=V,
                max_position_embeddings=64, original_max_position_embeddings=original,
                rms_norm_eps=1e-5, tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0,
                attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=None,
                sliding_window=None, attn_implementation="eager", **rope(10000.0, scaling))
    args.update(kw)
    return Phi3ForCausalLM(Phi3Config(**args))


# Fixtures after the first four: their norm scales spread (spread_norms).
SPREAD = {"qwen3", "llama3", "llama-linear", "llama-dynamic", "llama-yarn", "phi3",
          "phi3-longrope", "phi4-mini"}
# Gemma's norms scale by 1 + w: their w drawn from N(0, 0.5) (scales 1 ± 0.5,
# where a model reading w as the scale would use 0 ± 0.5).
GEMMA = {"gemma2", "gemma3"}
# Fixtures whose batch holds the padding id at its third position.
PADDED = {"gemma3"}


def spread_gemma_norms(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0.0, 0.5)


def parity_models():
    yield "gpt2", GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_inner=64, vocab_size=V, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
        layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0, attn_implementation="eager"))
    yield "llama", LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=V, max_position_embeddings=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
        attn_implementation="eager"))
    yield "qwen2", Qwen2ForCausalLM(Qwen2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=V, max_position_embeddings=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, use_sliding_window=False,
        attn_implementation="eager"))
    yield "bert", BertForMaskedLM(BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=V, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12, hidden_act="gelu",
        attn_implementation="eager"))
    # Qwen3: RMSNorm on each query and key head; a head size (16) that is not
    # hidden / heads (8).
    yield "qwen3", Qwen3ForCausalLM(Qwen3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, vocab_size=V, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        use_sliding_window=False, attn_implementation="eager", **rope(1000000.0)))
    # Llama 3.2-style: llama3 RoPE scaling, base 500000, tied head, head size 16.
    # Wavelengths 6.3, 32, 167, … against an original context of 16: the
    # fastest blended (between 16/4 and 16), the rest divided by the factor.
    yield "llama3", llama_with(
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        theta=500000.0, head_dim=16, max_position_embeddings=512)
    yield "llama-linear", llama_with({"rope_type": "linear", "factor": 4.0})
    # Dynamic NTK: the batch's 8 positions exceed the 2 of the context, so
    # the base grows (13^(8/6) times).
    yield "llama-dynamic", llama_with({"rope_type": "dynamic", "factor": 4.0},
                                      max_position_embeddings=2)
    # YaRN with factor = max_position_embeddings / original (both readings agree).
    yield "llama-yarn", llama_with(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    # Phi-3: fused qkv_proj (q, k, v rows) and gate_up_proj (gate, up rows),
    # untied head, full rotary.
    yield "phi3", phi3_with(64, tied=False, partial_rotary_factor=1.0)
    # Phi-3.5-mini-style: longrope scaling, the batch (8) within the original
    # context (16): the short factors, and the attention factor of a context
    # grown 4 times (sqrt(1 + ln 4 / ln 16)).
    yield "phi3-longrope", phi3_with(
        16, tied=False,
        scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0, 6.0],
                 "long_factor": [1.0, 2.0, 5.0, 12.0], "original_max_position_embeddings": 16})
    # Phi-4-mini-style: partial rotary (3/4 of each head of 8), longrope with
    # the batch past the original context (4): the long factors; tied head.
    yield "phi4-mini", phi3_with(
        4, tied=True, partial_rotary_factor=0.75,
        scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0],
                 "long_factor": [1.0, 4.0, 16.0], "partial_rotary_factor": 0.75,
                 "original_max_position_embeddings": 4})
    # Gemma 2: three blocks (sliding, full, sliding by the class's pattern), a
    # window of 3 of the batch's 8 positions, head size 16 (hidden / heads is
    # 8), scores scaled by 12^-1/2, attention and logits soft-capped by caps
    # the values reach (tanh far from linear there: without the caps the
    # loss moves by 0.3%).
    yield "gemma2", Gemma2ForCausalLM(Gemma2Config(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, vocab_size=V, max_position_embeddings=64,
        rms_norm_eps=1e-6, query_pre_attn_scalar=12, sliding_window=3,
        attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
        attn_implementation="eager", **rope(10000.0)))
    # Gemma 3 (text): q/k norms (1 + w), sliding blocks with their own RoPE
    # base (10000) beside a full block with a linearly scaled global base
    # (1e6, factor 4), a window of 3, scores scaled by 32^-1/2, no
    # soft-capping; the class's padding id (0), which the batch holds
    # (PADDED), so the embedding's row 0 gets the tied head's gradient only.
    yield "gemma3", Gemma3ForCausalLM(Gemma3TextConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, vocab_size=V, max_position_embeddings=64,
        rms_norm_eps=1e-6, query_pre_attn_scalar=32, sliding_window=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))


def save_model_dir(model, out):
    """save_pretrained's model.safetensors and config.json into `out` (other
    files there stay; save_pretrained's others are dropped)."""
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    os.makedirs(out, exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    shutil.rmtree(tmp)


def write_parity(out, only=None):
    os.makedirs(out, exist_ok=True)
    for i, (name, model) in enumerate(parity_models()):
        if only and name not in only:
            continue
        torch.manual_seed(100 + i)
        perturb(model)
        if name in SPREAD:
            spread_norms(model)
        if name in GEMMA:
            spread_gemma_norms(model)
        model.eval()  # no dropout (all probabilities are 0 anyway)
        tokens = torch.randint(0, V, (B, S + 1))
        if name in PADDED:
            tokens[:, 2] = model.config.pad_token_id
        batch = {}
        if name == "bert":
            targets = tokens[:, :S]
            keep = torch.ones(B, S, dtype=torch.int64)
            keep[1, S - 3:] = 0  # the second sequence ends with 3 padding tokens
            masked = (torch.rand(B, S) < 0.3) & (keep == 1)
            masked[:, 1] = True
            input_ids = torch.where(masked, torch.full_like(targets, V - 1), targets)
            loss_mask = masked.float()
            batch["attention_mask"] = keep.to(torch.int32)
            logits = model(input_ids=input_ids, attention_mask=keep).logits
        else:
            input_ids, targets = tokens[:, :S], tokens[:, 1:]
            loss_mask = torch.ones(B, S)
            loss_mask[0, 0] = 0.0  # a loss mask that is not all ones
            logits = model(input_ids=input_ids).logits
        nll = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), reduction="none")
        mask = loss_mask.reshape(-1)
        loss = (nll * mask).sum() / mask.sum()
        loss.backward()

        save_model_dir(model, os.path.join(out, name))
        ref = {f"grad.{n.removeprefix('transformer.')}": p.grad.contiguous()
               for n, p in model.named_parameters()}
        ref.update(batch)
        ref["input_ids"] = input_ids.to(torch.int32).contiguous()
        ref["targets"] = targets.to(torch.int32).contiguous()
        ref["loss_mask"] = loss_mask.contiguous()
        ref["logits"] = logits.detach().float().contiguous()
        ref["loss"] = loss.detach().reshape(1)
        if name in SPREAD:
            rotary = model.model.rotary_emb
            ref["rope.inv_freq"] = rotary.inv_freq.detach().double().contiguous()
            ref["rope.attention_scaling"] = torch.tensor([float(rotary.attention_scaling)],
                                                         dtype=torch.float64)
        save_file(ref, os.path.join(out, name + ".ref.safetensors"))
        print(name, "loss", loss.item(), "params", sum(p.numel() for p in model.parameters()))
        write_bf16(model, name, input_ids, targets, loss_mask, batch, out)


def write_bf16(model, name, input_ids, targets, loss_mask, batch, out):
    """<name>.bf16.safetensors: the logits, loss and gradients (as f32) of
    the same model and batch computed by transformers in bfloat16 (weights
    rounded to bf16, the loss on the logits in float32), the error a 16-bit
    step makes by itself."""
    import copy
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    m16.zero_grad(set_to_none=True)
    if "attention_mask" in batch:
        logits = m16(input_ids=input_ids, attention_mask=batch["attention_mask"].long()).logits
    else:
        logits = m16(input_ids=input_ids).logits
    nll = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), reduction="none")
    mask = loss_mask.reshape(-1)
    loss = (nll * mask).sum() / mask.sum()
    loss.backward()
    ref = {f"grad.{n.removeprefix('transformer.')}": p.grad.float().contiguous()
           for n, p in m16.named_parameters()}
    ref["logits"] = logits.detach().float().contiguous()
    ref["loss"] = loss.detach().reshape(1)
    save_file(ref, os.path.join(out, name + ".bf16.safetensors"))


# The fine-tuning fixture.
EOS = "<|endoftext|>"
FT_VOCAB = 256
FT_SEQ, FT_MICRO_BATCH = 32, 2
PRETRAIN_STEPS, PRETRAIN_BATCH = 300, 8


def lines_of(text):
    """The pieces oomfix's data pipeline tokenizes: each line with its line break
    (Rust's str::split_inclusive('\\n'))."""
    parts = text.split("\n")
    pieces = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        pieces.append(parts[-1])
    return pieces


def pipeline_ids(tok, text, eos_id):
    """The token ids oomfix reads from a plain-text file: one document,
    tokenized line by line without special tokens, then the end-of-text id."""
    ids = []
    for piece in lines_of(text):
        ids.extend(tok.encode(piece, add_special_tokens=False).ids)
    ids.append(eos_id)
    return ids


def windows(ids, batch, seq):
    """The first `batch` windows of seq + 1 ids, as DataSource::next_windows reads them."""
    pos, out = 0, []
    for _ in range(batch):
        out.append([ids[(pos + k) % len(ids)] for k in range(seq + 1)])
        pos = (pos + seq) % len(ids)
    return out


def train_tokenizer(text):
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=FT_VOCAB, special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(lines_of(text), trainer)
    assert tok.get_vocab_size() == FT_VOCAB, tok.get_vocab_size()
    return tok


def write_finetune(out):
    with open(os.path.join(out, "train.txt"), encoding="utf-8") as f:
        text = f.read()
    tok = train_tokenizer(text)
    eos_id = tok.token_to_id(EOS)
    ids = pipeline_ids(tok, text, eos_id)

    torch.manual_seed(7)
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=FT_VOCAB, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    data = torch.tensor(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(PRETRAIN_STEPS):
        starts = torch.randint(0, len(ids) - FT_SEQ - 1, (PRETRAIN_BATCH,))
        batch = torch.stack([data[s:s + FT_SEQ + 1] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == PRETRAIN_STEPS - 1:
            print(f"pretraining step {step}: loss {loss.item():.4f}")

    save_model_dir(model, out)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS,
                   "eos_token": EOS, "model_max_length": 64}, f, indent=2)
        f.write("\n")

    # The reference, from the files as written.
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.eval()
    first = windows(ids, FT_MICRO_BATCH, FT_SEQ)
    w = torch.tensor(first)
    with torch.no_grad():
        out_ = model(input_ids=w, labels=w)
        logits = model(input_ids=w[:, :FT_SEQ]).logits
    manual = F.cross_entropy(logits.float().reshape(-1, FT_VOCAB), w[:, 1:].reshape(-1))
    assert abs(manual.item() - out_.loss.item()) < 1e-6 * manual.item(), (manual, out_.loss)
    reference = {
        "data": "train.txt",
        "seq_len": FT_SEQ,
        "micro_batch": FT_MICRO_BATCH,
        "eos_token_id": eos_id,
        "tokens": len(ids),
        "first_windows": first,
        "first_loss": out_.loss.item(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        # One key a line, each value on its line.
        f.write("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}"
                                     for k, v in reference.items()) + "\n}\n")
    print("finetune: tokens", len(ids), "first micro-batch loss", out_.loss.item())


LORA_MODELS = ("gpt2", "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def peft_name(name):
    """The name PEFT saves a parameter of the PEFT model under (no adapter name)."""
    return name.replace(".default", "")


def write_lora(out):
    """<name>.lora.safetensors and <name>.lora.bf16.safetensors (see above)."""
    import copy
    import warnings

    import peft
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for i, name in enumerate(LORA_MODELS):
        ref = load_file(os.path.join(out, name + ".ref.safetensors"))
        base = AutoModelForCausalLM.from_pretrained(os.path.join(out, name), dtype=torch.float32,
                                                    attn_implementation="eager")
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GPT-2's Conv1D: fan_in_fan_out set to True
            model = peft.get_peft_model(base, config)
        model.eval()
        torch.manual_seed(300 + i)
        adapters = {}
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.2)
                    adapters["lora." + peft_name(n)] = p.detach().clone().contiguous()
        input_ids, targets = ref["input_ids"].long(), ref["targets"].long()
        loss_mask = ref["loss_mask"]
        for suffix, m in (("lora", model), ("lora.bf16", copy.deepcopy(model).to(torch.bfloat16))):
            m.zero_grad(set_to_none=True)
            logits = m(input_ids=input_ids).logits
            nll = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1),
                                  reduction="none")
            mask = loss_mask.reshape(-1)
            loss = (nll * mask).sum() / mask.sum()
            loss.backward()
            values = {"grad." + peft_name(n): p.grad.float().contiguous()
                      for n, p in m.named_parameters() if p.requires_grad}
            values["logits"] = logits.detach().float().contiguous()
            values["loss"] = loss.detach().float().reshape(1)
            if suffix == "lora":
                values.update(adapters)
            save_file(values, os.path.join(out, f"{name}.{suffix}.safetensors"))
            print(name, suffix, "loss", loss.item(), "adapter tensors", len(adapters))


def main(root, only=None):
    print("transformers", transformers.__version__, "torch", torch.__version__,
          "tokenizers", tokenizers.__version__)
    torch.manual_seed(0)
    write_parity(os.path.join(root, "train"), only)
    if not only:
        write_lora(os.path.join(root, "train"))
        write_finetune(os.path.join(root, "finetune"))


if __name__ == "__main__":
    args = sys.argv[1:]
    lora_only = "--lora" in args
    args = [a for a in args if a != "--lora"]
    root = args[0] if args else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
    # ONLY=name,name writes those parity fixtures alone (their seeds are
    # their places in parity_models, so the files are the same either way).
    only = set(filter(None, os.environ.get("ONLY", "").split(",")))
    if lora_only:
        write_lora(os.path.join(root, "train"))
    else:
        main(root, only)

