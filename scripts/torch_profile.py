#!/usr/bin/env python3
"""One PyTorch training step under torch.profiler, kernel by kernel, for the
profile beside oomfix's (scripts/profile-step.sh).

usage: torch_profile.py OUT_JSON CONFIG
  CONFIG as scripts/torch_step.py takes it (MODEL:BATCH:SEQ:PRECISION:CKPT:ATTN[:OPT[:compile]])

Builds the model and the step exactly as torch_step.py does, runs the
warm-up steps it runs (two under compile), then profiles one step and writes
{"config", "device", "step_ms", "kernels": [{"name", "count", "us"}]}: each
CUDA kernel's (and memcpy/memset's) count and total device time in that step.
step_ms is the step's wall time under the profiler.
"""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torch_step


def main(out, spec):
    fields = spec.split(":")
    model_name, batch, seq, precision, ckpt, attn = fields[:6]
    compiled = fields[7:] == ["compile"]
    batch, seq = int(batch), int(seq)
    model, vocab = torch_step.build(model_name, attn)
    model.train()
    if int(ckpt):
        model.gradient_checkpointing_enable()
    forward = torch.compile(model) if compiled else model
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=precision == "bf16"):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3 if compiled else 2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, {"name": e.name, "count": 0, "us": 0.0})
            k["count"] += 1
            k["us"] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    json.dump({"side": "pytorch-compile" if compiled else "pytorch-eager", "config": spec,
               "device": torch.cuda.get_device_name(), "step_ms": ms,
               "kernels": sorted(kernels.values(), key=lambda k: -k["us"])}, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
