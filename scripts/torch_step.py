#!/usr/bin/env python3
"""PyTorch's half of the side-by-side (scripts/side-by-side.sh): HF transformers
models built from config with random init, trained on cuda:0 with
torch.optim.AdamW(fused=True); one JSON line per configuration.

usage: torch_step.py [--steps N] [--cap SECONDS] CONFIG...
  CONFIG = MODEL:BATCH:SEQ:PRECISION:CKPT:ATTN[:OPT[:compile]]
  MODEL gpt2 (GPT2Config(), dropout off) | gpt2-medium | tinyllama (TinyLlama-1.1B shape)
  PRECISION fp32 | bf16 (torch.autocast, fp32 weights and optimizer state)
  CKPT 0 | 1 (model.gradient_checkpointing_enable(): every block)
  ATTN sdpa | eager (attn_implementation)
  OPT fused (default: torch.optim.AdamW(fused=True) on the GPU) | offload (the
      optimizer half of ZeRO-Offload in plain PyTorch: the model's weights in
      the PRECISION dtype on the GPU, no autocast; fp32 masters and gradient
      buffers in pinned host memory, torch.optim.AdamW(fused=True) on the CPU;
      each step copies the gradients down and the updated weights back up)
  compile: the model wrapped in torch.compile (default mode, the whole
      model; the optimizer step stays as OPT says). Its first step compiles
      and a second warms up any recompilation; both are untimed, and the
      first's time is reported as first_step_s, with compile_s = first_step_s
      less the median step

Step 1 is a warm-up (optimizer state, cuBLAS handles; under compile, steps 1
and 2); the peak statistics are reset after the warm-up and cover the N
measured steps; step time is the median of those steps, each bracketed by
torch.cuda.synchronize(). Each line names the GPU (`device`). A configuration
that runs out of memory, past --cap seconds or into another error is reported
as such and the next one runs.
"""
import gc
import json
import signal
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig


class Timeout(Exception):
    pass


def on_alarm(signum, frame):
    raise Timeout()


def build(model, attn):
    if model in ("gpt2", "gpt2-medium"):
        # oomfix's models have no dropout: turn it off for a like-for-like step.
        kw = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        if model == "gpt2-medium":
            kw.update(n_layer=24, n_embd=1024, n_head=16)
        cfg = GPT2Config(**kw)
    elif model == "tinyllama":
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
    else:
        raise SystemExit(f"unknown model {model!r}")
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return m.to(torch.float32), cfg.vocab_size


def offloaded_adamw(params):
    """A step function: gradients to pinned fp32 host buffers, AdamW on fp32 host
    masters, updated weights back into the GPU parameters."""
    params = list(params)
    masters = [p.detach().to("cpu", torch.float32).pin_memory() for p in params]
    for m in masters:
        m.grad = torch.empty(m.shape, dtype=torch.float32, pin_memory=True)
    try:
        opt, kind = torch.optim.AdamW(masters, lr=3e-4, fused=True), "fused"
    except (RuntimeError, ValueError):
        opt, kind = torch.optim.AdamW(masters, lr=3e-4, foreach=True), "foreach"

    def step():
        for p, m in zip(params, masters):
            m.grad.copy_(p.grad, non_blocking=True)
            p.grad = None
        torch.cuda.synchronize()
        opt.step()
        for p, m in zip(params, masters):
            p.data.copy_(m, non_blocking=True)
    return step, kind


def run(spec, steps):
    fields = spec.split(":")
    model_name, batch, seq, precision, ckpt, attn = fields[:6]
    offload = fields[6:7] == ["offload"]
    compiled = fields[7:] == ["compile"]
    if fields[6:7] not in ([], ["fused"], ["offload"]) or fields[7:] not in ([], ["compile"]):
        raise SystemExit(f"unknown optimizer or mode in {spec!r} (OPT fused|offload, then compile)")
    batch, seq, ckpt = int(batch), int(seq), int(ckpt)
    line = dict(side="pytorch", model=model_name, batch=batch, seq=seq, precision=precision,
                ckpt=ckpt, optimizer="cpu-adamw" if offload else "fused-adamw", attn=attn,
                compile=compiled, device=torch.cuda.get_device_name())
    model = opt = None
    try:
        model, vocab = build(model_name, attn)
        line["params"] = sum(p.numel() for p in model.parameters())
        line["attn_effective"] = model.config._attn_implementation
        line["param_device"] = str(next(model.parameters()).device)
        model.train()
        if ckpt:
            model.gradient_checkpointing_enable()
        forward = torch.compile(model) if compiled else model
        gen = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        if offload:
            model.to(dtype)
            opt, line["cpu_adamw"] = offloaded_adamw(model.parameters())
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)

        def step():
            with torch.autocast("cuda", dtype=dtype, enabled=precision == "bf16" and not offload):
                loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            if offload:
                opt()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            return loss.detach()

        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        line["first_step_s"] = time.perf_counter() - t
        if compiled:
            step()
            torch.cuda.synchronize()
        line["resident_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loss = step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        line.update(status="ok", peak_alloc_bytes=torch.cuda.max_memory_allocated(),
                    peak_reserved_bytes=torch.cuda.max_memory_reserved(),
                    step_ms=statistics.median(times), step_ms_all=times, loss=float(loss))
        if compiled:
            line["compile_s"] = line["first_step_s"] - line["step_ms"] / 1e3
    except torch.cuda.OutOfMemoryError as e:
        line.update(status="oom", error=str(e).splitlines()[0])
    except Timeout:
        line.update(status="timeout")
    except Exception as e:  # a failure of one configuration (say, under compile) ends only it
        line.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        del model, opt
        forward = None
        if compiled:
            torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    return line


def main(argv):
    steps, cap = 5, 120
    while argv and argv[0].startswith("--"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--steps":
            steps = int(value)
        elif flag == "--cap":
            cap = int(value)
        else:
            raise SystemExit(f"unknown flag {flag}")
    signal.signal(signal.SIGALRM, on_alarm)
    for spec in argv:
        print(f"pytorch: {spec}", file=sys.stderr, flush=True)
        signal.alarm(cap)
        try:
            line = run(spec, steps)
        finally:
            signal.alarm(0)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
