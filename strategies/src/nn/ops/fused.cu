// Fused layer ops (fused.rs), compiled at run time with NVRTC (see cuda.rs).
//
// Norms: one warp per row (no block barriers); each row's mean and variance
// are summed in f32 (two passes over the row, as the CPU does) and reduced
// with warp shuffles. Elementwise ops (bias, GELU, SwiGLU) are grid-stride
// loops. Arithmetic is in f32 for every storage dtype.
//
// Bf16, F16, to_f32, from_f32 and the integer typedefs come from
// oomfix-strategies' half.cuh, prepended when the source is compiled.

// The sum of v over the warp, the same value in every lane.
__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// The first element of this warp's row of h (one row per warp), or false
// past the last of `rows`.
__device__ __forceinline__ bool warp_row(u64 rows, u64 h, u64 &base) {
    const u64 row = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    base = row * h;
    return row < rows;
}

#define LANE_STRIDE(j, h) for (u64 j = threadIdx.x % 32; j < (h); j += 32)

// The row's mean (0 for RMS norm) and 1/sqrt(var + eps) (RMS: of the mean square).
template <typename T>
__device__ void row_stats(const T *row, u64 h, float eps, int rms, float &mean, float &rstd) {
    mean = 0.0f;
    if (!rms) {
        float s = 0.0f;
        LANE_STRIDE(j, h) s += to_f32(row[j]);
        mean = warp_sum(s) / (float)h;
    }
    float q = 0.0f;
    LANE_STRIDE(j, h) {
        float d = to_f32(row[j]) - mean;
        q += d * d;
    }
    rstd = rsqrtf(warp_sum(q) / (float)h + eps);
}

// y = (x - mean) * rstd * (w + offset) (+ b); b may be null.
template <typename T>
__device__ void norm(const T *x, const T *w, const T *b, T *y, u64 rows, u64 h, float eps, int rms,
                     float offset) {
    u64 base;
    if (!warp_row(rows, h, base)) return;
    float mean, rstd;
    row_stats(x + base, h, eps, rms, mean, rstd);
    LANE_STRIDE(j, h) {
        float v = (to_f32(x[base + j]) - mean) * rstd * (to_f32(w[j]) + offset);
        if (b) v += to_f32(b[j]);
        y[base + j] = from_f32<T>(v);
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * (w + offset) (RMS: no mean(g)).
template <typename T>
__device__ void norm_dx(const T *x, const T *w, const T *dy, T *dx, u64 rows, u64 h, float eps, int rms,
                        float offset) {
    u64 base;
    if (!warp_row(rows, h, base)) return;
    float mean, rstd;
    row_stats(x + base, h, eps, rms, mean, rstd);
    float sg = 0.0f, sgx = 0.0f;
    LANE_STRIDE(j, h) {
        float g = to_f32(dy[base + j]) * (to_f32(w[j]) + offset);
        sg += g;
        sgx += g * (to_f32(x[base + j]) - mean) * rstd;
    }
    float mean_g = rms ? 0.0f : warp_sum(sg) / (float)h;
    float mean_gx = warp_sum(sgx) / (float)h;
    LANE_STRIDE(j, h) {
        float xhat = (to_f32(x[base + j]) - mean) * rstd;
        float g = to_f32(dy[base + j]) * (to_f32(w[j]) + offset);
        dx[base + j] = from_f32<T>(rstd * (g - mean_g - xhat * mean_gx));
    }
}

// out = dy * xhat in f32 (summed over rows afterwards into the scale's gradient).
template <typename T>
__device__ void norm_scale_grad(const T *x, const T *dy, float *out, u64 rows, u64 h, float eps, int rms) {
    u64 base;
    if (!warp_row(rows, h, base)) return;
    float mean, rstd;
    row_stats(x + base, h, eps, rms, mean, rstd);
    LANE_STRIDE(j, h) out[base + j] = to_f32(dy[base + j]) * (to_f32(x[base + j]) - mean) * rstd;
}

#define GRID_STRIDE(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// gelu(x) and gelu'(x): tanh approximation (form 0) or erf (form 1).
__device__ __forceinline__ void gelu_and_slope(float x, int form, float &y, float &slope) {
    if (form == 0) {
        const float k = 0.7978845608f, c = 0.044715f;
        float t = tanhf(k * (x + c * x * x * x));
        y = 0.5f * x * (1.0f + t);
        slope = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * c * x * x);
    } else {
        float cdf = 0.5f * (1.0f + erff(x * 0.70710678118f));
        y = x * cdf;
        slope = cdf + x * expf(-0.5f * x * x) * 0.3989422804f;
    }
}

// Rotary position embedding with the heads moved first. One thread per pair
// (i, i + d/2) of one row; a row is (batch bb, head hh, position p). Forward
// (back = 0): x [b, s, n, d] -> y [b, n, s, d], y_i = x_i cos_i + x_{i+d/2} sin_i,
// y_{i+d/2} = x_{i+d/2} cos_{i+d/2} + x_i sin_{i+d/2}. Backward (back = 1): the
// transposed map, dy [b, n, s, d] -> dx [b, s, n, d]. cos, sin: [s, d] f32,
// row p for position p; per_token: [b * s, d], row bb * s + p for token p of
// batch row bb (packed documents, each counting its positions from 0).
template <typename T>
__device__ void rope(const T *src, T *dst, const float *cos, const float *sin, u64 b, u64 s, u64 n,
                     u64 d, int back, int per_token) {
    u64 half = d / 2;
    GRID_STRIDE(t, b * n * s * half) {
        u64 i = t % half, row = t / half;
        u64 p = row % s, hh = (row / s) % n, bb = row / (s * n);
        u64 heads_first = ((bb * n + hh) * s + p) * d, seq_first = ((bb * s + p) * n + hh) * d;
        u64 in = back ? heads_first : seq_first, out = back ? seq_first : heads_first;
        const u64 t_row = per_token ? bb * s + p : p;  // the tables' row of this token
        const float *c = cos + t_row * d, *sn = sin + t_row * d;
        float lo = to_f32(src[in + i]), hi = to_f32(src[in + i + half]);
        float s_lo = back ? sn[i + half] : sn[i], s_hi = back ? sn[i] : sn[i + half];
        dst[out + i] = from_f32<T>(lo * c[i] + hi * s_lo);
        dst[out + i + half] = from_f32<T>(hi * c[i + half] + lo * s_hi);
    }
}

// *p += v atomically: f32 with the hardware add, 16-bit values by
// compare-and-swap on the aligned 32-bit word that holds them.
__device__ __forceinline__ void atomic_add(float *p, float v) { atomicAdd(p, v); }
template <typename T>
__device__ __forceinline__ void atomic_add(T *p, float v) {
    u32 *word = reinterpret_cast<u32 *>(reinterpret_cast<size_t>(p) & ~(size_t)3);
    const int shift = (reinterpret_cast<size_t>(p) & 2) ? 16 : 0;
    u32 old = *word, seen;
    do {
        seen = old;
        T cur;
        cur.bits = (u16)(seen >> shift);
        const u32 bits = from_f32<T>(to_f32(cur) + v).bits;
        old = atomicCAS(word, seen, (seen & ~(0xffffu << shift)) | (bits << shift));
    } while (old != seen);
}

// The embedding lookup's backward: dst[ids[r], c] += src[r, c] for the rows r
// of src [n, h]; dst [vocab, h] starts at zero. Ids at or past vocab are skipped.
template <typename T>
__device__ void embedding_grad(const T *src, const u32 *ids, T *dst, u64 n, u64 h, u64 vocab) {
    GRID_STRIDE(i, n * h) {
        const u64 id = ids[i / h];
        if (id < vocab) atomic_add(dst + id * h + i % h, to_f32(src[i]));
    }
}

// Attention probabilities, in place: each row of n scores (one query's) becomes
// softmax(scale * score) over the keys it sees, zero elsewhere. Row r is query
// i = r % s_q of batch r / rows_per_batch; causal: key j is seen when
// j <= i + n - s_q; keep (null: every key) is [batch, n], zero masking key j;
// start (null: 0) is [batch, s_q], the first key query i sees (packed
// documents).
// One warp per row: an online max and sum, then the normalised write. A row
// that sees no key is all zeros.
template <typename T>
__device__ void attention_probs(T *p, const unsigned char *keep, const u32 *start, u64 rows, u64 n,
                                u64 s_q, u64 rows_per_batch, float scale, int causal) {
    u64 base;
    if (!warp_row(rows, n, base)) return;
    const u64 row = base / n;
    const unsigned char *kp = keep ? keep + (row / rows_per_batch) * n : nullptr;
    const u64 first = start ? start[(row / rows_per_batch) * s_q + row % s_q] : 0;
    const u64 last = row % s_q + n + 1;  // causal: keys [0, last - s_q) are seen
    const u64 seen = !causal ? n : last <= s_q ? 0 : last - s_q < n ? last - s_q : n;
    float m = NEG_INF, l = 0.0f;
    LANE_STRIDE(j, seen) {
        if (j < first || (kp && !kp[j])) continue;
        const float x = to_f32(p[base + j]) * scale;
        if (x > m) {
            l = l * expf(m - x) + 1.0f;
            m = x;
        } else {
            l += expf(x - m);
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
        const float mm = fmaxf(m, m2);
        if (mm != NEG_INF)
            l = (m == NEG_INF ? 0.0f : l * expf(m - mm)) + (m2 == NEG_INF ? 0.0f : l2 * expf(m2 - mm));
        m = mm;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    LANE_STRIDE(j, n) {
        float v = 0.0f;
        if (first <= j && j < seen && (!kp || kp[j])) v = expf(to_f32(p[base + j]) * scale - m) * inv;
        p[base + j] = from_f32<T>(v);
    }
}

// The probabilities' backward: ds = scale * p * (dp - sum_j p_j dp_j), one warp per row.
template <typename T>
__device__ void attention_probs_grad(const T *p, const T *dp, T *ds, u64 rows, u64 n, float scale) {
    u64 base;
    if (!warp_row(rows, n, base)) return;
    float dot = 0.0f;
    LANE_STRIDE(j, n) dot += to_f32(p[base + j]) * to_f32(dp[base + j]);
    dot = warp_sum(dot);
    LANE_STRIDE(j, n) ds[base + j] = from_f32<T>(scale * to_f32(p[base + j]) * (to_f32(dp[base + j]) - dot));
}

#define KERNELS(NAME, T)                                                                         \
    extern "C" __global__ void norm_##NAME(const T *x, const T *w, const T *b, T *y, u64 rows,  \
                                           u64 h, float eps, int rms, float offset) {            \
        norm<T>(x, w, b, y, rows, h, eps, rms, offset);                                          \
    }                                                                                            \
    extern "C" __global__ void norm_dx_##NAME(const T *x, const T *w, const T *dy, T *dx,       \
                                              u64 rows, u64 h, float eps, int rms,               \
                                              float offset) {                                    \
        norm_dx<T>(x, w, dy, dx, rows, h, eps, rms, offset);                                     \
    }                                                                                            \
    extern "C" __global__ void norm_scale_grad_##NAME(const T *x, const T *dy, float *out,      \
                                                      u64 rows, u64 h, float eps, int rms) {     \
        norm_scale_grad<T>(x, dy, out, rows, h, eps, rms);                                       \
    }                                                                                            \
    extern "C" __global__ void add_bias_##NAME(T *y, const T *b, u64 n, u64 cols) {             \
        GRID_STRIDE(i, n) y[i] = from_f32<T>(to_f32(y[i]) + to_f32(b[i % cols]));                \
    }                                                                                            \
    extern "C" __global__ void gelu_##NAME(const T *x, T *y, u64 n, int form) {                 \
        GRID_STRIDE(i, n) {                                                                      \
            float v, s;                                                                          \
            gelu_and_slope(to_f32(x[i]), form, v, s);                                            \
            y[i] = from_f32<T>(v);                                                               \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void gelu_grad_##NAME(const T *x, const T *dy, T *dx, u64 n, int form) { \
        GRID_STRIDE(i, n) {                                                                      \
            float v, s;                                                                          \
            gelu_and_slope(to_f32(x[i]), form, v, s);                                            \
            dx[i] = from_f32<T>(to_f32(dy[i]) * s);                                              \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void swiglu_##NAME(const T *g, const T *u, T *y, u64 n) {             \
        GRID_STRIDE(i, n) {                                                                      \
            float gv = to_f32(g[i]);                                                             \
            y[i] = from_f32<T>(gv * sigmoid(gv) * to_f32(u[i]));                                 \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void swiglu_grad_##NAME(const T *g, const T *u, const T *dy, T *out,  \
                                                  u64 n) {                                       \
        GRID_STRIDE(i, n) {                                                                      \
            float gv = to_f32(g[i]), uv = to_f32(u[i]), d = to_f32(dy[i]), s = sigmoid(gv);      \
            out[i] = from_f32<T>(d * uv * s * (1.0f + gv * (1.0f - s)));                         \
            out[n + i] = from_f32<T>(d * gv * s);                                                \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void rope_##NAME(const T *src, T *dst, const float *cos,               \
                                           const float *sin, u64 b, u64 s, u64 n, u64 d,         \
                                           int back, int per_token) {                            \
        rope<T>(src, dst, cos, sin, b, s, n, d, back, per_token);                                \
    }                                                                                            \
    extern "C" __global__ void embedding_grad_##NAME(const T *src, const u32 *ids, T *dst, u64 n, \
                                                     u64 h, u64 vocab) {                         \
        embedding_grad<T>(src, ids, dst, n, h, vocab);                                           \
    }                                                                                            \
    extern "C" __global__ void attention_probs_##NAME(T *p, const unsigned char *keep,          \
                                                      const u32 *start, u64 rows, u64 n,         \
                                                      u64 s_q, u64 rows_per_batch, float scale,  \
                                                      int causal) {                              \
        attention_probs<T>(p, keep, start, rows, n, s_q, rows_per_batch, scale, causal);         \
    }                                                                                            \
    extern "C" __global__ void attention_probs_grad_##NAME(const T *p, const T *dp, T *ds,       \
                                                           u64 rows, u64 n, float scale) {       \
        attention_probs_grad<T>(p, dp, ds, rows, n, scale);                                      \
    }

KERNELS(f32, float)
KERNELS(bf16, Bf16)
KERNELS(f16, F16)
