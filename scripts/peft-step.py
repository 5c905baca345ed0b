"""PyTorch + PEFT LoRA training steps on a model shape, beside oomfix's
(scripts/gpu-lora.sh): a causal LM of `config.json`'s shape with random
weights in bfloat16 on the GPU, PEFT LoRA adapters (rank R, alpha 2R, every
linear projection of the blocks, PEFT's default fp32 adapters), gradient
checkpointing (non-reentrant), fused AdamW on the adapters, random tokens;
ACCUM micro-batches of MICRO x SEQ tokens per optimizer step. Prints one
JSON object: the card, the step times (the first is warm-up), the peak
allocated and reserved bytes (torch.cuda.max_memory_*).

Usage: python scripts/peft-step.py CONFIG_JSON --rank R --seq SEQ --micro MICRO --accum ACCUM --steps N [--device cuda]
"""

import argparse
import json
import time

import peft
import torch
import transformers


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    config = transformers.AutoConfig.from_pretrained(a.config)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(a.device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    torch.set_default_dtype(torch.float32)
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

    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        sync()
        start = time.perf_counter()
        for _ in range(a.accum):
            ids = torch.randint(0, config.vocab_size, (a.micro, a.seq), device=a.device)
            loss = model(input_ids=ids, labels=ids).loss / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    print(json.dumps({
        "card": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__,
        "adapters": sum(p.numel() for p in trainable),
        "tokens_per_step": a.micro * a.seq * a.accum,
        "step_seconds": times,
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }))


if __name__ == "__main__":
    main()
