// 16-bit floats for oomfix's NVRTC kernels, prepended to each kernel source
// when it is compiled (`CUDA_HALF_PRELUDE` in lib.rs). No CUDA headers, so
// NVRTC needs no include path: 16-bit values travel as their raw bits.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Minus infinity (NVRTC has no math headers, so no INFINITY).
#define NEG_INF (__int_as_float(0xff800000))

struct Bf16 { u16 bits; };
struct F16 { u16 bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(Bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
__device__ __forceinline__ float to_f32(F16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

// Round to nearest even, as the `half` crate converts: every non-NaN value
// gives the CPU's bits (a NaN stays a NaN).
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ Bf16 from_f32<Bf16>(float x) {
    Bf16 r;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
#else
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (u16)((u >> 16) | 0x0040u);
    } else {
        r.bits = (u16)((u >> 16) + (((u & 0x8000u) != 0 && (u & 0x17fffu) != 0) ? 1u : 0u));
    }
#endif
    return r;
}
template <> __device__ __forceinline__ F16 from_f32<F16>(float x) {
    F16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
