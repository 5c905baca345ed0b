// Cross-entropy forward and backward, compiled at run time with NVRTC (see cuda.rs).
//
// One thread block per row of the [n, v] logits. Each thread keeps an online
// (max, sum of exp) pair over its strided share of the row; the pairs are
// merged across the warp with shuffles and across warps through shared memory,
// giving the row's log-sum-exp in f32. The forward writes one loss per row;
// the backward reads the row again and writes g * (softmax - onehot) in the
// logits' dtype.
//
// Bf16, F16, to_f32, from_f32, NEG_INF and the integer typedefs come from
// oomfix-strategies' half.cuh, prepended when the source is compiled.


// Merges the online pair (m2, s2) into (m, s): s is a sum of exp(x - m).
__device__ __forceinline__ void merge(float &m, float &s, float m2, float s2) {
    float hi = fmaxf(m, m2);
    if (hi == NEG_INF) return;
    s = (m == NEG_INF ? 0.0f : s * expf(m - hi)) + (m2 == NEG_INF ? 0.0f : s2 * expf(m2 - hi));
    m = hi;
}

// The log-sum-exp of row[0..v), the same value in every thread of the block.
// blockDim.x is a multiple of 32 and at most 1024.
template <typename T>
__device__ float block_lse(const T *row, u64 v) {
    __shared__ float sm[32], ss[32];
    float m = NEG_INF, s = 0.0f;
    for (u64 j = threadIdx.x; j < v; j += blockDim.x) {
        float x = to_f32(row[j]);
        if (x > m) {
            s = (m == NEG_INF ? 0.0f : s * expf(m - x)) + 1.0f;
            m = x;
        } else if (x != NEG_INF) {
            s += expf(x - m);
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        merge(m, s, m2, s2);
    }
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads();
    m = lane < warps ? sm[lane] : NEG_INF;
    s = lane < warps ? ss[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        merge(m, s, m2, s2);
    }
    return m == NEG_INF ? NEG_INF : m + logf(s);
}

// Rows are `pitch` apart; the first v columns are classes, the rest padding.
template <typename T>
__device__ void nll(const T *logits, const unsigned *targets, float *out, u64 v, u64 pitch) {
    const T *row = logits + (u64)blockIdx.x * pitch;
    float lse = block_lse(row, v);
    if (threadIdx.x == 0) {
        unsigned t = targets[blockIdx.x];
        out[blockIdx.x] = t < v ? lse - to_f32(row[t]) : __int_as_float(0x7fc00000);
    }
}

template <typename T>
__device__ void nll_grad(const T *logits, const unsigned *targets, const float *grad, T *out, u64 v,
                         u64 pitch) {
    u64 base = (u64)blockIdx.x * pitch;
    const T *row = logits + base;
    float lse = block_lse(row, v);
    unsigned t = targets[blockIdx.x];
    float g = t < v ? grad[blockIdx.x] : __int_as_float(0x7fc00000);
    for (u64 j = threadIdx.x; j < pitch; j += blockDim.x) {
        float p = j < v ? expf(to_f32(row[j]) - lse) : 0.0f;
        out[base + j] = from_f32<T>(j < v ? g * (j == t ? p - 1.0f : p) : 0.0f);
    }
}

#define KERNELS(NAME, T)                                                                              \
    extern "C" __global__ void nll_##NAME(const T *logits, const unsigned *targets, float *out, u64 v, \
                                          u64 pitch) {                                                \
        nll<T>(logits, targets, out, v, pitch);                                                       \
    }                                                                                                 \
    extern "C" __global__ void nll_grad_##NAME(const T *logits, const unsigned *targets,              \
                                               const float *grad, T *out, u64 v, u64 pitch) {         \
        nll_grad<T>(logits, targets, grad, out, v, pitch);                                            \
    }

KERNELS(f32, float)
KERNELS(bf16, Bf16)
KERNELS(f16, F16)
