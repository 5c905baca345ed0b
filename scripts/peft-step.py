"""PyTorch + PEFT LoRA training steps on a model shape, beside oomfix's
(scripts/gpu-lora.sh): a causal LM of `config.json`'s shape with random
weights in bfloat16 on the GPU, PEFT LoRA adapters (rank R, alpha 2R, every
linear projection of the blocks, PEFT's default fp32 adapters; with
`--base nf4` every projection of the blocks is first replaced by
bitsandbytes' 4-bit NF4 `Linear4bit`, bf16 compute, as QLoRA does), gradient
checkpointing (non-reentrant), fused AdamW on the adapters, random tokens;
ACCUM micro-batches of MICRO x SEQ tokens per optimizer step. Prints one
JSON line per sequence length: the card, the step times (the first is
warm-up), the peak allocated and reserved bytes (torch.cuda.max_memory_*)
of those steps. With several lengths (a ladder, shortest first) the model is
built once and each length runs its steps in turn; a length that runs out of
the card's memory is reported with `"oom": true` and ends the ladder.

Usage: python scripts/peft-step.py CONFIG_JSON --rank R --seq SEQ [SEQ...] --micro MICRO --accum ACCUM --steps N [--base bf16|nf4|nf4-dq] [--device cuda]
"""

import argparse
import json
import time

import peft
import torch
import transformers


def quantize_blocks(model, double):
    """Replaces every linear projection of the blocks by bitsandbytes'
    4-bit NF4 layer (blocks of 64, bf16 compute; `double`: the absmax
    values double-quantized), one layer at a time."""
    import bitsandbytes as bnb

    for block in model.model.layers:
        for name, linear in list(block.named_modules()):
            if not isinstance(linear, torch.nn.Linear):
                continue
            parent, _, child = name.rpartition(".")
            q = bnb.nn.Linear4bit(linear.in_features, linear.out_features,
                                  bias=linear.bias is not None, compute_dtype=torch.bfloat16,
                                  compress_statistics=double, quant_type="nf4",
                                  device="meta")
            q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False,
                                         compress_statistics=double, quant_type="nf4")
            q.weight = q.weight.to(linear.weight.device)
            if linear.bias is not None:
                q.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
            setattr(block.get_submodule(parent) if parent else block, child, q)
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq", type=int, nargs="+", default=[512])
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--base", choices=["bf16", "nf4", "nf4-dq"], default="bf16")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    config = transformers.AutoConfig.from_pretrained(a.config)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(a.device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    torch.set_default_dtype(torch.float32)
    if a.base != "bf16":
        quantize_blocks(model, double=a.base == "nf4-dq")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0,
                           target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    cuda = a.device.startswith("cuda")
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=cuda)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for seq in a.seq:
        record = {
            "card": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "base": a.base,
            "adapters": sum(p.numel() for p in trainable),
            "seq": seq, "tokens_per_step": a.micro * seq * a.accum,
        }
        try:
            record.update(run_steps(model, opt, trainable, config, a, seq, cuda, sync))
        except torch.cuda.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            record["oom"] = True
        print(json.dumps(record), flush=True)
        if record.get("oom"):
            break
        if cuda:
            torch.cuda.empty_cache()


def run_steps(model, opt, trainable, config, a, seq, cuda, sync):
    """`a.steps` optimizer steps at `seq` tokens a sequence: their seconds
    and the peak allocated and reserved bytes while they ran."""
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        sync()
        start = time.perf_counter()
        for _ in range(a.accum):
            ids = torch.randint(0, config.vocab_size, (a.micro, seq), device=a.device)
            loss = model(input_ids=ids, labels=ids).loss / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    return {
        "step_seconds": times,
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }


if __name__ == "__main__":
    main()
