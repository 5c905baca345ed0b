// NF4 dequantization (see nf4.rs), compiled at run time with NVRTC (see
// cuda.rs). One thread per byte of codes (two values), grid-stride.
//
// The tables NF4_LEVELS (the 16 levels) and DYNAMIC_MAP (256 absmax levels) are
// defined before this source by cuda.rs (with NF4_TABLES), from the CPU's f32
// values.
//
// `nf4_<dtype>` reads an fp32 absmax per block of 64 values; `nf4dq_<dtype>`
// an 8-bit absmax code per block of 64, decoded with the dynamic map times
// its fp32 scale per 256 codes, plus the offset. Products and sums are rounded separately
// (__fmul_rn, __fadd_rn, no contraction into FMA), as the CPU computes them,
// so both give the same bits.
//
// Bf16, F16, from_f32 and the integer typedefs come from half.cuh.

typedef unsigned char u8;

#ifndef NF4_TABLES
// Without the tables (a compile check of this file alone): zeros.
__device__ __constant__ float NF4_LEVELS[16];
__device__ __constant__ float DYNAMIC_MAP[256];
#endif

template <typename T>
__device__ __forceinline__ void nf4_pair(const u8* __restrict__ codes, float absmax, u64 i, u64 n,
                                         T* __restrict__ out) {
    const u8 byte = codes[i];
    out[2 * i] = from_f32<T>(__fmul_rn(NF4_LEVELS[byte >> 4], absmax));
    if (2 * i + 1 < n) out[2 * i + 1] = from_f32<T>(__fmul_rn(NF4_LEVELS[byte & 15], absmax));
}

template <typename T>
__device__ __forceinline__ void nf4(const u8* __restrict__ codes, const float* __restrict__ absmax,
                                    u64 n, T* __restrict__ out) {
    const u64 bytes = (n + 1) / 2;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += stride) {
        nf4_pair(codes, absmax[i / 32], i, n, out);
    }
}

template <typename T>
__device__ __forceinline__ void nf4dq(const u8* __restrict__ codes, const u8* __restrict__ qabsmax,
                                      const float* __restrict__ scales, float offset, u64 n,
                                      T* __restrict__ out) {
    const u64 bytes = (n + 1) / 2;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += stride) {
        const u64 block = i / 32;
        const float absmax =
            __fadd_rn(__fmul_rn(DYNAMIC_MAP[qabsmax[block]], scales[block / 256]), offset);
        nf4_pair(codes, absmax, i, n, out);
    }
}

#define NF4_KERNELS(NAME, T)                                                                      \
    extern "C" __global__ void nf4_##NAME(const u8* codes, const float* absmax, u64 n, T* out) {  \
        nf4(codes, absmax, n, out);                                                               \
    }                                                                                             \
    extern "C" __global__ void nf4dq_##NAME(const u8* codes, const u8* qabsmax,                   \
                                            const float* scales, float offset, u64 n, T* out) {   \
        nf4dq(codes, qabsmax, scales, offset, n, out);                                            \
    }

NF4_KERNELS(f32, float)
NF4_KERNELS(bf16, Bf16)
NF4_KERNELS(f16, F16)
