#!/usr/bin/env python3
"""Check, on a Hopper GPU, the shared-memory layouts and descriptors that
flash.cu's warpgroup backward (`bwd_wgmma`) gives `wgmma`, one product at a
time against PyTorch, independently of the attention kernel.

Usage: python3 scripts/wgmma-layouts.py [STRATEGIES_SRC]
  STRATEGIES_SRC  folder holding half.cuh and attention/flash.cu
                  (default: strategies/src next to this script)

Needs CuPy (to compile with NVRTC for compute_90a) and PyTorch. Each case
fills two swizzled 64 x 64 bf16 tiles (`swz`) and multiplies them as the
kernel does:
  rs K-major B:        out = A B^T        (S^T = K Q^T)
  rs N-major B:        out = A B          (dV += P^T dO)
  ss M-major A, N-major B, 32 columns from column 32:
                       out[:, 32:] = A^T B[:, 32:]   (dQ = dS K, one warpgroup's half)
Prints one PASS/FAIL line per case (relative error against f32 PyTorch, pass
below 1e-5) and exits 1 if any fails.
"""
import os
import sys

import cupy as cp
import numpy as np
import torch

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(128) wgmma_layouts(const Bf16* A, const Bf16* B, float* out, int mode) {
#if WGMMA_OK
    __shared__ __align__(1024) u16 As[64 * 64];
    __shared__ __align__(1024) u16 Bs[64 * 64];
    const u16* a = reinterpret_cast<const u16*>(A);
    const u16* b = reinterpret_cast<const u16*>(B);
    for (int i = threadIdx.x; i < 64 * 64; i += 128) {
        const int r = i / 64, c = i % 64;
        As[swz(r, c)] = a[i];
        Bs[swz(r, c)] = b[i];
    }
    fence_async_smem();
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float d[8][4], h[4][4];
    u32 fa[4][4];
    for (int kk = 0; kk < 4; ++kk) {
        const int r = warp * 16 + g, c = kk * 16 + 2 * t;
        fa[kk][0] = lds32(As + swz(r, c));
        fa[kk][1] = lds32(As + swz(r + 8, c));
        fa[kk][2] = lds32(As + swz(r, c + 8));
        fa[kk][3] = lds32(As + swz(r + 8, c + 8));
    }
    for (int n = 0; n < 8; ++n)
        for (int e = 0; e < 4; ++e) d[n][e] = 0.f;
    wg_fence();
    if (mode == 0) {
        for (int kk = 0; kk < 4; ++kk) Wg<Bf16>::rs<0>(d, fa[kk], wg_desc(Bs + kk * 16), kk);
    } else if (mode == 1) {
        for (int kk = 0; kk < 4; ++kk) Wg<Bf16>::rs<1>(d, fa[kk], wg_desc(Bs + kk * 16 * 64), kk);
    } else {
        for (int kk = 0; kk < 4; ++kk)
            Wg<Bf16>::ss<1, 1>(h, wg_desc(As + kk * 16 * 64), wg_desc(Bs + kk * 16 * 64 + 32), kk);
    }
    wg_commit();
    wg_wait<0>();
    wg_pin(d);
    wg_pin(h);
    if (mode == 2)
        for (int n = 0; n < 4; ++n)
            for (int e = 0; e < 4; ++e) d[4 + n][e] = h[n][e];
    for (int n = 0; n < 8; ++n)
        for (int e = 0; e < 4; ++e) out[(warp * 16 + g + (e >> 1) * 8) * 64 + n * 8 + 2 * t + (e & 1)] = d[n][e];
#endif
}
"""


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    src_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "strategies", "src")
    source = "".join(open(os.path.join(src_dir, p)).read() for p in ("half.cuh", "attention/flash.cu")) + KERNEL
    kernel = cp.RawModule(code=source, options=("--gpu-architecture=compute_90a",)).get_function("wgmma_layouts")
    torch.manual_seed(0)
    a = torch.randn(64, 64, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(64, 64, dtype=torch.bfloat16, device="cuda")
    af, bf = a.float(), b.float()
    half = torch.cat([torch.zeros(64, 32, device="cuda"), (af.T @ bf)[:, 32:]], 1)
    cases = [("rs, K-major B: A B^T", af @ bf.T), ("rs, N-major B: A B", af @ bf),
             ("ss, M-major A, N-major B, columns 32-63: A^T B", half)]
    failed = 0
    for mode, (name, ref) in enumerate(cases):
        out = torch.zeros(64, 64, device="cuda")
        kernel((1,), (128,), (a.data_ptr(), b.data_ptr(), out.data_ptr(), np.int32(mode)))
        torch.cuda.synchronize()
        err = ((out - ref).norm() / ref.norm()).item()
        print(f"{'PASS' if err < 1e-5 else 'FAIL'}  {name}: relative error {err:.2e}")
        failed += err >= 1e-5
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
