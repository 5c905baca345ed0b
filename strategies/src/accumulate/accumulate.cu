// In-place gradient accumulation, compiled at run time with NVRTC after the
// 16-bit prelude (see cuda.rs). Each launch is a grid-stride loop over one
// tensor; arithmetic in f32, one rounding to the accumulator's type per element.

// acc[i] = acc[i] + g[i]
template <typename A, typename G>
__device__ __forceinline__ void add(A* __restrict__ acc, const G* __restrict__ g, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        acc[i] = from_f32<A>(to_f32(acc[i]) + to_f32(g[i]));
    }
}

// acc[i] = g[i]
template <typename A, typename G>
__device__ __forceinline__ void assign(A* __restrict__ acc, const G* __restrict__ g, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        acc[i] = from_f32<A>(to_f32(g[i]));
    }
}

// acc[i] = acc[i] * s
template <typename A>
__device__ __forceinline__ void scale(A* __restrict__ acc, float s, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        acc[i] = from_f32<A>(to_f32(acc[i]) * s);
    }
}

// Entry points: add_<acc>_<g>, assign_<acc>_<g>, scale_<acc>.
#define ADD_ENTRY(AN, A, GN, G)                                                              \
    extern "C" __global__ void add_##AN##_##GN(A* __restrict__ acc, const G* __restrict__ g, \
                                               u64 n) {                                      \
        add<A, G>(acc, g, n);                                                                \
    }                                                                                        \
    extern "C" __global__ void assign_##AN##_##GN(A* __restrict__ acc,                       \
                                                  const G* __restrict__ g, u64 n) {          \
        assign<A, G>(acc, g, n);                                                             \
    }
#define ENTRIES(AN, A)                                                                       \
    ADD_ENTRY(AN, A, f32, float)                                                             \
    ADD_ENTRY(AN, A, bf16, Bf16)                                                             \
    ADD_ENTRY(AN, A, f16, F16)                                                               \
    extern "C" __global__ void scale_##AN(A* __restrict__ acc, float s, u64 n) {             \
        scale<A>(acc, s, n);                                                                 \
    }

ENTRIES(f32, float)
ENTRIES(bf16, Bf16)
ENTRIES(f16, F16)
