#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention forward and forward+backward, timed like
examples/gpu_attention.rs: batch 8, 12 heads, head dim 64, causal, s = 1024 ...
8192, bf16 and f32; loss = sum(o * w); median of 10 runs after 3 warm-up runs,
synchronising around each; peak = torch.cuda.max_memory_allocated during one
forward+backward (inputs included).

Prints one line per shape: PERF dtype seq fwd_ms fwd_bwd_ms peak_alloc_MiB
(PyTorch's choice of backend); with --backends, also one line per backend
forced through torch.nn.attention.sdpa_kernel: PERF-<backend> ... (a backend
that rejects the inputs prints PERF-<backend> dtype seq - - -). Last,
TinyLlama-1.1B's grouped-query shape (batch 4, 32 query and 4 key/value heads,
s = 2048, bf16) as transformers runs it: PERF-gqa-repeat (keys and values
repeated to 32 heads, then SDPA) and PERF-gqa (SDPA's enable_gqa). After each
shape a line LOSS dtype seq ms (LOSS-gqa): the step's loss and its backward
alone, o a leaf of the output's shape, which the benchmark subtracts to
compare the attention itself.
usage: sdpa_bench.py [--seqs 1024,2048,4096,8192] [--dtypes bf16,f32] [--no-gqa] [--backends]
"""
import argparse, statistics, sys, time

import torch
import torch.nn.functional as F


def timed(fn, warm=3, reps=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms)


def loss_ms(mk):
    """The timed step's loss alone: sum(o * w) and its backward, o a leaf of
    the attention output's shape (no attention)."""
    o, w = mk(True), mk(False)

    def step():
        o.grad = None
        (o * w).sum().backward()

    return timed(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--no-gqa", action="store_true", help="leave out TinyLlama's shape")
    ap.add_argument("--backends", action="store_true")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    forced = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
              ("efficient", SDPBackend.EFFICIENT_ATTENTION)] if args.backends else []
    dev = torch.device("cuda:0")
    print(f"# sdpa_bench: torch {torch.__version__}, {torch.cuda.get_device_name(0)}; "
          f"backends flash={torch.backends.cuda.flash_sdp_enabled()} "
          f"mem_efficient={torch.backends.cuda.mem_efficient_sdp_enabled()} "
          f"cudnn={torch.backends.cuda.cudnn_sdp_enabled()} math={torch.backends.cuda.math_sdp_enabled()}")
    b, h, d = 8, 12, 64
    dtypes = args.dtypes.split(",")
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float32, "f32")]:
        if name not in dtypes:
            continue
        for s in (int(x) for x in args.seqs.split(",")):
            mk = lambda grad: torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=grad)
            q, k, v, w = mk(True), mk(True), mk(True), mk(False)

            def fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def step():
                q.grad = k.grad = v.grad = None
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                (o * w).sum().backward()

            def measure():
                f_ms = timed(fwd)
                fb_ms = timed(step)
                q.grad = k.grad = v.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                return f"{f_ms:.3f} {fb_ms:.3f} {torch.cuda.max_memory_allocated() / 2**20:.0f}"

            print(f"PERF {name} {s} {measure()}", flush=True)
            print(f"LOSS {name} {s} {loss_ms(mk):.3f}", flush=True)
            for label, backend in forced:
                try:
                    with sdpa_kernel(backend):
                        print(f"PERF-{label} {name} {s} {measure()}", flush=True)
                except RuntimeError:
                    print(f"PERF-{label} {name} {s} - - -", flush=True)
            del q, k, v, w
            torch.cuda.empty_cache()

    if args.no_gqa:
        return 0
    b, h, kv, s = 4, 32, 4, 2048
    mk = lambda heads, grad: torch.randn(b, heads, s, d, device=dev, dtype=torch.bfloat16, requires_grad=grad)
    q, k, v, w = mk(h, True), mk(kv, True), mk(kv, True), mk(h, False)
    for label, attend in [
        ("gqa-repeat", lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1), is_causal=True)),
        ("gqa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
    ]:
        def fwd():
            with torch.no_grad():
                attend()

        def step():
            q.grad = k.grad = v.grad = None
            (attend() * w).sum().backward()

        f_ms, fb_ms = timed(fwd), timed(step)
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        print(f"PERF-{label} bf16 {s} {f_ms:.3f} {fb_ms:.3f} {torch.cuda.max_memory_allocated() / 2**20:.0f}",
              flush=True)
    print(f"LOSS-gqa bf16 {s} {loss_ms(lambda grad: mk(h, grad)):.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
