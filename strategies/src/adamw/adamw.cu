// Fused AdamW step, compiled at run time with NVRTC (see cuda.rs).
//
// One launch updates one parameter tensor in place: it reads p (f32, bf16 or
// f16), g (f32, bf16 or f16), m and v (f32) once and writes p, m and v once.
// The arithmetic is the CPU kernel's (adamw.rs, `adamw_serial`) operation for
// operation; compiled without FMA contraction and with IEEE division and
// square root it gives the same f32 results.
//
// Bf16, F16, to_f32, from_f32 and the integer typedefs come from half.cuh,
// prepended when the source is compiled.

// Per-step scalars; the field order matches `Coeffs` in adamw.rs.
struct Coeffs {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float scale_m, scale_v, eps, lr, decay, grad_scale;
};


// Four consecutive elements, loaded or stored as one access (16 bytes for f32,
// 8 bytes for 16-bit types).
template <typename T> struct Quad;
template <> struct Quad<float> {
    typedef float4 Raw;
    static __device__ __forceinline__ void unpack(Raw r, float x[4]) { x[0] = r.x; x[1] = r.y; x[2] = r.z; x[3] = r.w; }
    static __device__ __forceinline__ Raw pack(const float x[4]) { return make_float4(x[0], x[1], x[2], x[3]); }
};
template <typename H> struct Quad16 {
    typedef uint2 Raw;
    static __device__ __forceinline__ void unpack(Raw r, float x[4]) {
        H h;
        h.bits = (u16)(r.x & 0xffffu); x[0] = to_f32(h);
        h.bits = (u16)(r.x >> 16);     x[1] = to_f32(h);
        h.bits = (u16)(r.y & 0xffffu); x[2] = to_f32(h);
        h.bits = (u16)(r.y >> 16);     x[3] = to_f32(h);
    }
    static __device__ __forceinline__ Raw pack(const float x[4]) {
        Raw r;
        r.x = (unsigned)from_f32<H>(x[0]).bits | ((unsigned)from_f32<H>(x[1]).bits << 16);
        r.y = (unsigned)from_f32<H>(x[2]).bits | ((unsigned)from_f32<H>(x[3]).bits << 16);
        return r;
    }
};
template <> struct Quad<Bf16> : Quad16<Bf16> {};
template <> struct Quad<F16> : Quad16<F16> {};

// The update of one element; returns the new parameter value.
__device__ __forceinline__ float adamw_one(float p, float g, float& m, float& v, const Coeffs& c) {
    g = g * c.grad_scale;
    m = c.beta1 * m + c.one_minus_beta1 * g;
    v = c.beta2 * v + c.one_minus_beta2 * (g * g);
    float update = (m * c.scale_m) / (sqrtf(v * c.scale_v) + c.eps);
    return p * c.decay - update * c.lr;
}

// Grid-stride loop. With `vectorized` set (every pointer aligned to four
// elements) the first n - n % 4 elements go four at a time; the rest, or all
// of them otherwise, one at a time.
template <typename P, typename G>
__device__ __forceinline__ void adamw(P* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                      float* __restrict__ v, u64 n, int vectorized, Coeffs c) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 done = 0;
    if (vectorized) {
        const u64 quads = n / 4;
        typedef typename Quad<P>::Raw PRaw;
        typedef typename Quad<G>::Raw GRaw;
        for (u64 i = tid; i < quads; i += stride) {
            float pf[4], gf[4], mf[4], vf[4];
            Quad<P>::unpack(reinterpret_cast<const PRaw*>(p)[i], pf);
            Quad<G>::unpack(reinterpret_cast<const GRaw*>(g)[i], gf);
            Quad<float>::unpack(reinterpret_cast<const float4*>(m)[i], mf);
            Quad<float>::unpack(reinterpret_cast<const float4*>(v)[i], vf);
#pragma unroll
            for (int k = 0; k < 4; ++k) pf[k] = adamw_one(pf[k], gf[k], mf[k], vf[k], c);
            reinterpret_cast<PRaw*>(p)[i] = Quad<P>::pack(pf);
            reinterpret_cast<float4*>(m)[i] = Quad<float>::pack(mf);
            reinterpret_cast<float4*>(v)[i] = Quad<float>::pack(vf);
        }
        done = quads * 4;
    }
    for (u64 i = done + tid; i < n; i += stride) {
        float mi = m[i], vi = v[i];
        p[i] = from_f32<P>(adamw_one(to_f32(p[i]), to_f32(g[i]), mi, vi, c));
        m[i] = mi;
        v[i] = vi;
    }
}

// One entry point per (parameter, gradient) dtype pair: adamw_<p>_<g>.
#define ADAMW_ENTRY(PN, P, GN, G)                                                                 \
    extern "C" __global__ void adamw_##PN##_##GN(P* __restrict__ p, const G* __restrict__ g,        \
                                                 float* __restrict__ m, float* __restrict__ v,    \
                                                 u64 n, int vectorized, Coeffs c) {               \
        adamw<P, G>(p, g, m, v, n, vectorized, c);                                                \
    }
#define ADAMW_ENTRIES(PN, P)            \
    ADAMW_ENTRY(PN, P, f32, float)      \
    ADAMW_ENTRY(PN, P, bf16, Bf16)      \
    ADAMW_ENTRY(PN, P, f16, F16)

ADAMW_ENTRIES(f32, float)
ADAMW_ENTRIES(bf16, Bf16)
ADAMW_ENTRIES(f16, F16)
