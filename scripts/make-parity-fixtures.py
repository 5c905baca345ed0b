#!/usr/bin/env python3
"""Reference values from Hugging Face transformers for oomfix's parity tests.

Writes, under tests/fixtures (or the directory given), from fixed seeds:

train/<name>/model.safetensors, train/<name>/config.json
    Tiny models with random weights, biases and norm scales, as save_pretrained
    writes them: GPT-2; Llama with grouped-query attention and an untied head;
    Qwen2 with q/k/v biases and a tied head; BERT masked-LM.
train/<name>.ref.safetensors
    input_ids, targets, loss_mask (BERT: and attention_mask, the second
    sequence ending with 3 padding tokens), the logits (f32 [b, s, V]), the
    loss and the gradient of every parameter (grad.<Hub name>). The loss is
    the mean cross-entropy over the positions loss_mask selects, computed on
    the logits in float32, as oomfix's models define it.
    Used by tests/train_models.rs.

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
(written with torch 2.15, transformers 5.25, tokenizers 0.23). Every run
with the same versions writes the same files.

Usage: python scripts/make-parity-fixtures.py [FIXTURES_DIR]   (default: tests/fixtures)
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
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

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


def write_parity(out):
    os.makedirs(out, exist_ok=True)
    for i, (name, model) in enumerate(parity_models()):
        torch.manual_seed(100 + i)
        perturb(model)
        model.eval()  # no dropout (all probabilities are 0 anyway)
        tokens = torch.randint(0, V, (B, S + 1))
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
        save_file(ref, os.path.join(out, name + ".ref.safetensors"))
        print(name, "loss", loss.item(), "params", sum(p.numel() for p in model.parameters()))


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


def main(root):
    print("transformers", transformers.__version__, "torch", torch.__version__,
          "tokenizers", tokenizers.__version__)
    torch.manual_seed(0)
    write_parity(os.path.join(root, "train"))
    write_finetune(os.path.join(root, "finetune"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
