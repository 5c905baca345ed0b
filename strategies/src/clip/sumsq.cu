// Sum of squares of a step's gradients, compiled at run time with NVRTC (see
// cuda.rs).
//
// `sumsq_<dtype>` reads one tensor once with a grid-stride loop and writes one
// partial sum per block into `partials`; after the last tensor, `sum_partials`
// (one block) adds every partial into `out[0]`. The partials are added in a
// fixed order, so the result does not depend on scheduling. Each element is
// widened to f64 before it is squared (exact for f32, bf16 and f16), and the
// sums are f64, as the CPU path accumulates.
//
// Bf16, F16, to_f32 and the integer typedefs come from half.cuh, prepended
// when the source is compiled.

#define SUMSQ_THREADS 256

// The sum of `v` over the block, valid in thread 0. `shared` holds one double
// per warp.
__device__ __forceinline__ double block_sum(double v, double* shared) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = 0.0;
    if (warp == 0) {
        if (lane < (int)(blockDim.x / 32)) v = shared[lane];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    return v;
}

__device__ __forceinline__ double sq(float x) {
    const double d = (double)x;
    return d * d;
}

// Four consecutive elements as one access (16 bytes of f32, 8 of 16-bit).
__device__ __forceinline__ double quad_sumsq(const float* x, u64 i) {
    const float4 r = reinterpret_cast<const float4*>(x)[i];
    return sq(r.x) + sq(r.y) + sq(r.z) + sq(r.w);
}
template <typename H> __device__ __forceinline__ double quad16_sumsq(const H* x, u64 i) {
    const uint2 r = reinterpret_cast<const uint2*>(x)[i];
    H a, b, c, d;
    a.bits = (u16)(r.x & 0xffffu);
    b.bits = (u16)(r.x >> 16);
    c.bits = (u16)(r.y & 0xffffu);
    d.bits = (u16)(r.y >> 16);
    return sq(to_f32(a)) + sq(to_f32(b)) + sq(to_f32(c)) + sq(to_f32(d));
}
__device__ __forceinline__ double quad_sumsq(const Bf16* x, u64 i) { return quad16_sumsq(x, i); }
__device__ __forceinline__ double quad_sumsq(const F16* x, u64 i) { return quad16_sumsq(x, i); }

// With `vectorized` set (x aligned to four elements) the first n - n % 4
// elements go four at a time; the rest, or all of them otherwise, one at a time.
template <typename T>
__device__ __forceinline__ void sumsq(const T* __restrict__ x, u64 n, int vectorized,
                                      double* __restrict__ partials) {
    __shared__ double shared[SUMSQ_THREADS / 32];
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    double acc = 0.0;
    u64 done = 0;
    if (vectorized) {
        const u64 quads = n / 4;
        for (u64 i = tid; i < quads; i += stride) acc += quad_sumsq(x, i);
        done = quads * 4;
    }
    for (u64 i = done + tid; i < n; i += stride) acc += sq(to_f32(x[i]));
    acc = block_sum(acc, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

#define SUMSQ_ENTRY(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(SUMSQ_THREADS)                               \
        sumsq_##NAME(const T* __restrict__ x, u64 n, int vectorized, double* __restrict__ partials) { \
        sumsq<T>(x, n, vectorized, partials);                                                 \
    }
SUMSQ_ENTRY(f32, float)
SUMSQ_ENTRY(bf16, Bf16)
SUMSQ_ENTRY(f16, F16)

// One block: out[0] = the sum of partials[0..n], in a fixed order.
extern "C" __global__ void __launch_bounds__(SUMSQ_THREADS)
    sum_partials(const double* __restrict__ partials, u64 n, double* __restrict__ out) {
    __shared__ double shared[SUMSQ_THREADS / 32];
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) acc += partials[i];
    acc = block_sum(acc, shared);
    if (threadIdx.x == 0) out[0] = acc;
}
