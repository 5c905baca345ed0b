// Memory-efficient attention (the FlashAttention-2 scheme) for CUDA, compiled
// at run time with NVRTC (see cuda.rs).
//
// Tensors are contiguous: q, o, dq [b, heads, s_q, d]; k, v, dk, dv
// [b, kv_heads, s_k, d]; lse and delta [b, heads, s_q] (f32); keep [b, s_k]
// (u8, 1 = key kept) when `has_keep`; start [b, s_q] (u32, each query's first
// visible key: packed documents) when `has_start`. Query head h reads
// key/value head h / (heads / kv_heads). Query i of batch row bb sees key j
// when j < s_k, the key is kept, j >= start[bb, i], and, with `causal`,
// j <= i + s_k - s_q. Tiles are not skipped by their starts: a query tile
// walks the keys from 0, masking those before each row's start. A row that sees no key gets zeros
// and lse = -inf.
//
// Two families of kernels, each templated on the element type T and on
// D, the head dimension rounded up to 64 or 128 (the tail is zero-filled):
//   *_simt: plain f32 arithmetic on CUDA cores, for every dtype (devices
//           older than compute capability 8.0);
//   *_mma:  tensor-core kernels (mma.sync, f32 accumulation; f32 inputs as
//           3xTF32), four warps per block, each owning 16 rows (32 in the
//           16-bit forward with d <= 64: two groups sharing each K/V fragment).
// Grids are (tiles, heads, batch), so that the blocks of one head run side by
// side and share its K/V (forward) or Q/dO (backward) tiles in L2.
// Forward: one block per query tile, online softmax over the key tiles.
// Backward: `delta` = rowsum(dO * O), then
//   SIMT: one kernel per key tile that sums dK and dV over the query heads of
//         its group, one per query tile for dQ; both recompute the
//         probabilities from lse (seven products per tile pair);
//   mma:  one kernel per key tile for dK, dV and its share of dQ, added to an
//         f32 accumulator with vector atomics (FlashAttention-2's five
//         products per tile pair), then converted to T.
// A third backward, *_wgmma (16-bit, d <= 64, compute_90a), does the mma one's
// work on Hopper's warpgroup instructions, two warpgroups per 128-key tile.
//
// Bf16, F16, to_f32, from_f32 and u16/u32/u64 come from half.cuh, prepended
// when the source is compiled.

typedef unsigned char u8;
typedef long long i64;

// Sizes and flags; the field order matches `KernelParams` in cuda.rs.
struct Params {
    int b, heads, kv_heads, s_q, s_k, d;
    float scale;  // applied to q.k
    int causal;
    int has_keep;
    // Tensor-core backward: blocks per key tile and key/value head, each
    // taking heads / kv_heads / kv_splits query heads of the group (with more
    // than one, dK and dV are added into f32 accumulators).
    int kv_splits;
    int has_start;
};

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f


// ---------------------------------------------------------------------------
// Masks.

// End (exclusive) of the keys query i may see, before padding.
__device__ __forceinline__ int key_end(const Params& p, int i) {
    if (!p.causal) return p.s_k;
    int e = i + 1 + p.s_k - p.s_q;
    return e < 0 ? 0 : (e > p.s_k ? p.s_k : e);
}

// First query that sees key j under the causal mask (0 without it).
__device__ __forceinline__ int first_query(const Params& p, int j) {
    if (!p.causal) return 0;
    int i = j - p.s_k + p.s_q;
    return i < 0 ? 0 : i;
}

// The block's batch x head index in a (tiles, heads, batch) grid (query
// heads for the forward and dQ kernels, key/value heads for dK/dV).
__device__ __forceinline__ int block_head() { return blockIdx.z * gridDim.y + blockIdx.y; }

// The masks of one batch row: its keys' keep flags [s_k] (read when
// `has_keep`) and its queries' first visible keys [s_q] (read when
// `has_start`).
struct RowMask {
    const u8* keep;
    const u32* start;
};

__device__ __forceinline__ RowMask row_mask(const Params& p, const u8* keep, const u32* start, int bb) {
    return RowMask{keep + (i64)bb * p.s_k, start + (i64)bb * p.s_q};
}

__device__ __forceinline__ bool visible(const Params& p, const RowMask& mask_row, int i, int j) {
    if (i >= p.s_q || j >= p.s_k) return false;
    if (p.causal && j > i + p.s_k - p.s_q) return false;
    if (p.has_keep && mask_row.keep[j] == 0) return false;
    if (p.has_start && j < (int)mask_row.start[i]) return false;
    return true;
}

// ---------------------------------------------------------------------------
// Backward preprocessing: delta[row] = sum_c dO[row, c] * O[row, c].

// The sum of the products of two 32-bit words' elements of T.
template <typename T> __device__ __forceinline__ float dot_word(u32 x, u32 y) {
    return to_f32(T{(u16)x}) * to_f32(T{(u16)y}) + to_f32(T{(u16)(x >> 16)}) * to_f32(T{(u16)(y >> 16)});
}
template <> __device__ __forceinline__ float dot_word<float>(u32 x, u32 y) {
    return __uint_as_float(x) * __uint_as_float(y);
}

// 2^lg threads per row (at most a warp, aligned in it), each over columns
// part, part + 2^lg, ...: 16-byte vectors when `vec` (d and the rows' starts
// multiples of 16 bytes), else single elements.
template <typename T>
__device__ void delta_kernel(const T* __restrict__ o, const T* __restrict__ dout, float* __restrict__ delta,
                             i64 rows, int d, int lg, int vec) {
    const i64 gid = (i64)blockIdx.x * blockDim.x + threadIdx.x, row = gid >> lg;
    const int tpr = 1 << lg, part = (int)(gid & (tpr - 1));
    float acc = 0.f;
    if (row < rows) {
        const T* a = o + row * d;
        const T* b = dout + row * d;
        if (vec) {
            constexpr int W = 16 / sizeof(T);
            for (int c = part * W; c < d; c += tpr * W) {
                const uint4 x = *reinterpret_cast<const uint4*>(a + c), y = *reinterpret_cast<const uint4*>(b + c);
                acc += dot_word<T>(x.x, y.x) + dot_word<T>(x.y, y.y) + dot_word<T>(x.z, y.z) + dot_word<T>(x.w, y.w);
            }
        } else {
            for (int c = part; c < d; c += tpr) acc += to_f32(a[c]) * to_f32(b[c]);
        }
    }
    for (int off = tpr / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && part == 0) delta[row] = acc;
}

// ===========================================================================
// SIMT kernels: 256 threads as a 16 x 16 grid (ty, tx); a thread owns rows
// ty*4 .. ty*4+3 of a 64-row tile and the columns tx + 16*j. Tiles live in
// shared memory as f32 with row stride D + 1 (no bank conflicts).

#define SB 64     // rows per tile (queries and keys)
#define SPAD 1

// Loads rows r0 .. r0+SB-1 (of `rows`) of a row-major [rows, d] matrix into a
// [SB][D+1] f32 tile, zero outside; `mul` scales the values.
template <typename T, int D>
__device__ __forceinline__ void load_tile_f32(float* tile, const T* src, int r0, int rows, int d, float mul) {
    const int LD = D + SPAD;
    for (int idx = threadIdx.x; idx < SB * D; idx += blockDim.x) {
        int r = idx / D, c = idx % D;
        float x = 0.f;
        if (r0 + r < rows && c < d) x = to_f32(src[(i64)(r0 + r) * d + c]) * mul;
        tile[r * LD + c] = x;
    }
}

// acc[a][c] += sum over j of P[ty * 4 + a][j] B[j][tx + 16 c] for a thread's
// rows of a 64-row tile P (rows of PLD) and columns of B (64 rows of LD).
template <int NC, int LD, int PLD>
__device__ __forceinline__ void product_add(float (&acc)[4][NC], const float* P, const float* B, int ty, int tx) {
#pragma unroll 4
    for (int j = 0; j < SB; ++j) {
        float bv[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) bv[c] = B[j * LD + tx + 16 * c];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const float pe = P[(ty * 4 + a) * PLD + j];
#pragma unroll
            for (int c = 0; c < NC; ++c) acc[a][c] += pe * bv[c];
        }
    }
}

template <typename T, int D>
__device__ void fwd_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         T* __restrict__ o, float* __restrict__ lse, const u8* __restrict__ keep,
                         const u32* __restrict__ start, Params p) {
    const int LD = D + SPAD, PLD = SB + 1, NC = D / 16;
    extern __shared__ __align__(16) float smem[];
    float* Qs = smem;
    float* Ks = Qs + SB * LD;
    float* Vs = Ks + SB * LD;
    float* Ps = Vs + SB * LD;
    const int bh = block_head();
    const int tiles = (p.s_q + SB - 1) / SB;
    const int i0 = (tiles - 1 - (int)blockIdx.x) * SB;
    const int bb = bh / p.heads, h = bh % p.heads;
    const int kvh = h / (p.heads / p.kv_heads);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const T* qh = q + (i64)bh * p.s_q * p.d;
    const T* kh = k + ((i64)bb * p.kv_heads + kvh) * p.s_k * p.d;
    const T* vh = v + ((i64)bb * p.kv_heads + kvh) * p.s_k * p.d;
    const RowMask mask_row = row_mask(p, keep, start, bb);
    // Scores in the log2 domain: q is pre-multiplied by scale * log2(e).
    load_tile_f32<T, D>(Qs, qh, i0, p.s_q, p.d, p.scale * LOG2E);

    float m[4], l[4], acc[4][NC];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = NEG_INF;
        l[a] = 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[a][c] = 0.f;
    }
    const int last = min(i0 + SB, p.s_q) - 1;
    const int kend = key_end(p, last);
    for (int j0 = 0; j0 < kend; j0 += SB) {
        __syncthreads();
        load_tile_f32<T, D>(Ks, kh, j0, p.s_k, p.d, 1.f);
        load_tile_f32<T, D>(Vs, vh, j0, p.s_k, p.d, 1.f);
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) s[a][b] = 0.f;
#pragma unroll 8
        for (int kk = 0; kk < D; ++kk) {
            float qv[4], kv[4];
#pragma unroll
            for (int a = 0; a < 4; ++a) qv[a] = Qs[(ty * 4 + a) * LD + kk];
#pragma unroll
            for (int b = 0; b < 4; ++b) kv[b] = Ks[(tx + 16 * b) * LD + kk];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) s[a][b] += qv[a] * kv[b];
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int i = i0 + ty * 4 + a;
            float mx = NEG_INF;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                if (!visible(p, mask_row, i, j0 + tx + 16 * b)) s[a][b] = NEG_INF;
                mx = fmaxf(mx, s[a][b]);
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m[a], mx);
            const float m_use = m_new == NEG_INF ? 0.f : m_new;
            const float alpha = exp2f(m[a] - m_use);
            m[a] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                float e = exp2f(s[a][b] - m_use);
                sum += e;
                Ps[(ty * 4 + a) * PLD + tx + 16 * b] = e;
            }
            l[a] = l[a] * alpha + sum;  // this thread's part of the row sum
#pragma unroll
            for (int c = 0; c < NC; ++c) acc[a][c] *= alpha;
        }
        __syncthreads();
        product_add<NC, LD, PLD>(acc, Ps, Vs, ty, tx);
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        float sum = l[a];
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        const int i = i0 + ty * 4 + a;
        if (i >= p.s_q) continue;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        T* orow = o + ((i64)bh * p.s_q + i) * p.d;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int col = tx + 16 * c;
            if (col < p.d) orow[col] = from_f32<T>(acc[a][c] * inv);
        }
        if (tx == 0) lse[(i64)bh * p.s_q + i] = sum > 0.f ? (m[a] + log2f(sum)) * LN2 : NEG_INF;
    }
}

// dK and dV of one key tile: a thread owns keys ty*4 .. ty*4+3 of the tile.
// The SIMT backward's two products for a thread's 4 x 4 block of a pair of
// 64 x 64 tiles: s = A1 B1^T and dp = A2 B2^T over rows ty * 4 + a of A1, A2
// and rows tx + 16 b of B1, B2 (row-major f32 tiles, rows of LD, D columns).
template <int D, int LD>
__device__ __forceinline__ void products2(float (&s)[4][4], float (&dp)[4][4], const float* A1, const float* A2,
                                          const float* B1, const float* B2, int ty, int tx) {
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) s[a][b] = dp[a][b] = 0.f;
#pragma unroll 4
    for (int kk = 0; kk < D; ++kk) {
        float a1[4], a2[4], b1[4], b2[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            a1[a] = A1[(ty * 4 + a) * LD + kk];
            a2[a] = A2[(ty * 4 + a) * LD + kk];
        }
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            b1[b] = B1[(tx + 16 * b) * LD + kk];
            b2[b] = B2[(tx + 16 * b) * LD + kk];
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                s[a][b] += a1[a] * b1[b];
                dp[a][b] += a2[a] * b2[b];
            }
    }
}

template <typename T, int D>
__device__ void dkdv_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const T* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, const u8* __restrict__ keep, const u32* __restrict__ start,
                          T* __restrict__ dk, T* __restrict__ dv, Params p) {
    const int LD = D + SPAD, PLD = SB + 1, NC = D / 16;
    extern __shared__ __align__(16) float smem[];
    float* Ks = smem;
    float* Vs = Ks + SB * LD;
    float* Qs = Vs + SB * LD;
    float* Ds = Qs + SB * LD;  // dO
    float* Pt = Ds + SB * LD;  // P^T [key][query]
    float* St = Pt + SB * PLD; // dS^T
    float* Ls = St + SB * PLD; // lse * log2(e) of the query tile
    float* Es = Ls + SB;       // delta of the query tile
    const int bkv = block_head();
    const int j0 = blockIdx.x * SB;
    const int bb = bkv / p.kv_heads, kvh = bkv % p.kv_heads;
    const int group = p.heads / p.kv_heads;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const RowMask mask_row = row_mask(p, keep, start, bb);
    const float sl2 = p.scale * LOG2E;
    load_tile_f32<T, D>(Ks, k + (i64)bkv * p.s_k * p.d, j0, p.s_k, p.d, 1.f);
    load_tile_f32<T, D>(Vs, v + (i64)bkv * p.s_k * p.d, j0, p.s_k, p.d, 1.f);
    float gk[4][NC], gv[4][NC];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < NC; ++c) gk[a][c] = gv[a][c] = 0.f;
    const int qstart = (first_query(p, j0) / SB) * SB;
    for (int g = 0; g < group; ++g) {
        const i64 bh = (i64)bb * p.heads + kvh * group + g;
        const T* qh = q + bh * p.s_q * p.d;
        const T* dh = dout + bh * p.s_q * p.d;
        for (int i0 = qstart; i0 < p.s_q; i0 += SB) {
            __syncthreads();
            load_tile_f32<T, D>(Qs, qh, i0, p.s_q, p.d, 1.f);
            load_tile_f32<T, D>(Ds, dh, i0, p.s_q, p.d, 1.f);
            for (int r = threadIdx.x; r < SB; r += blockDim.x) {
                const bool in = i0 + r < p.s_q;
                Ls[r] = in ? lse[bh * p.s_q + i0 + r] * LOG2E : NEG_INF;
                Es[r] = in ? delta[bh * p.s_q + i0 + r] : 0.f;
            }
            __syncthreads();
            float s[4][4], dp[4][4];
            products2<D, D + SPAD>(s, dp, Ks, Vs, Qs, Ds, ty, tx);  // S^T, dP^T
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const int j = j0 + ty * 4 + a;
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int qi = tx + 16 * b;
                    const float ls = Ls[qi];
                    float pe = 0.f;
                    if (ls != NEG_INF && visible(p, mask_row, i0 + qi, j)) pe = exp2f(s[a][b] * sl2 - ls);
                    Pt[(ty * 4 + a) * PLD + qi] = pe;
                    St[(ty * 4 + a) * PLD + qi] = pe * (dp[a][b] - Es[qi]);
                }
            }
            __syncthreads();
#pragma unroll 4
            for (int qq = 0; qq < SB; ++qq) {
                float qv[NC], dv_[NC];
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    qv[c] = Qs[qq * LD + tx + 16 * c];
                    dv_[c] = Ds[qq * LD + tx + 16 * c];
                }
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                    const float pe = Pt[(ty * 4 + a) * PLD + qq];
                    const float se = St[(ty * 4 + a) * PLD + qq];
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        gv[a][c] += pe * dv_[c];
                        gk[a][c] += se * qv[c];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int j = j0 + ty * 4 + a;
        if (j >= p.s_k) continue;
        const i64 row = ((i64)bkv * p.s_k + j) * p.d;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int col = tx + 16 * c;
            if (col < p.d) {
                dk[row + col] = from_f32<T>(gk[a][c] * p.scale);
                dv[row + col] = from_f32<T>(gv[a][c]);
            }
        }
    }
}

// dQ of one query tile: a thread owns queries ty*4 .. ty*4+3.
template <typename T, int D>
__device__ void dq_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                        const u8* __restrict__ keep, const u32* __restrict__ start, T* __restrict__ dq, Params p) {
    const int LD = D + SPAD, PLD = SB + 1, NC = D / 16;
    extern __shared__ __align__(16) float smem[];
    float* Qs = smem;
    float* Ds = Qs + SB * LD;
    float* Ks = Ds + SB * LD;
    float* Vs = Ks + SB * LD;
    float* Ss = Vs + SB * LD;  // dS [query][key]
    const int bh = block_head();
    const int tiles = (p.s_q + SB - 1) / SB;
    const int i0 = (tiles - 1 - (int)blockIdx.x) * SB;
    const int bb = bh / p.heads, h = bh % p.heads;
    const int kvh = h / (p.heads / p.kv_heads);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const T* kh = k + ((i64)bb * p.kv_heads + kvh) * p.s_k * p.d;
    const T* vh = v + ((i64)bb * p.kv_heads + kvh) * p.s_k * p.d;
    const RowMask mask_row = row_mask(p, keep, start, bb);
    const float sl2 = p.scale * LOG2E;
    load_tile_f32<T, D>(Qs, q + (i64)bh * p.s_q * p.d, i0, p.s_q, p.d, 1.f);
    load_tile_f32<T, D>(Ds, dout + (i64)bh * p.s_q * p.d, i0, p.s_q, p.d, 1.f);
    float ls[4], es[4], gq[4][NC];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int i = i0 + ty * 4 + a;
        ls[a] = i < p.s_q ? lse[(i64)bh * p.s_q + i] * LOG2E : NEG_INF;
        es[a] = i < p.s_q ? delta[(i64)bh * p.s_q + i] : 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c) gq[a][c] = 0.f;
    }
    const int kend = key_end(p, min(i0 + SB, p.s_q) - 1);
    for (int j0 = 0; j0 < kend; j0 += SB) {
        __syncthreads();
        load_tile_f32<T, D>(Ks, kh, j0, p.s_k, p.d, 1.f);
        load_tile_f32<T, D>(Vs, vh, j0, p.s_k, p.d, 1.f);
        __syncthreads();
        float s[4][4], dp[4][4];
        products2<D, D + SPAD>(s, dp, Qs, Ds, Ks, Vs, ty, tx);  // S, dP
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int i = i0 + ty * 4 + a;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int kj = tx + 16 * b;
                float pe = 0.f;
                if (ls[a] != NEG_INF && visible(p, mask_row, i, j0 + kj)) pe = exp2f(s[a][b] * sl2 - ls[a]);
                Ss[(ty * 4 + a) * PLD + kj] = pe * (dp[a][b] - es[a]);
            }
        }
        __syncthreads();
        product_add<NC, LD, PLD>(gq, Ss, Ks, ty, tx);
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int i = i0 + ty * 4 + a;
        if (i >= p.s_q) continue;
        T* row = dq + ((i64)bh * p.s_q + i) * p.d;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int col = tx + 16 * c;
            if (col < p.d) row[col] = from_f32<T>(gq[a][c] * p.scale);
        }
    }
}

// ===========================================================================
// Tensor-core kernels: 128 threads = 4 warps, warp w owns rows 16w .. 16w+15
// of a 64-row tile. Tiles live in shared memory as the input type with row
// stride D + 8 elements (16-byte aligned rows; no bank conflicts for the
// fragment loads along rows). The kernels are written against a fragment
// policy `Frag<T>` that loads, multiplies and stores 16 x 16 blocks:
//   bf16 / f16: mma.sync m16n8k16 on the 16-bit values (f32 accumulation);
//   f32:        three mma.sync m16n8k8 tf32 products per k = 8 step (3xTF32:
//               each operand is split into a tf32 part and a tf32 remainder,
//               and big.big + big.small + small.big keeps ~f32 accuracy).
//
// mma.sync m16n8k16 fragments (g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16 x 8, k x n):      b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C (16 x 8):             c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
// so two adjacent C tiles of one row block are the A fragment of the next
// product (P or dS feed P.V, dS.K, ... straight from registers). The tf32
// fragments (A: a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4];
// B: b0 = B[t][g], b1 = B[t+4][g]) are used with the reduction index of each
// k = 8 step permuted (slot t is column 2t, slot t + 4 column 2t + 1), which
// makes C tiles A fragments there too, and row loads 64-bit wide.

#define MB 64     // rows per block tile
#define MPAD 8

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Four 8x8 16-bit matrices, transposed: rows are given by lanes 0-7 (matrix
// 0), 8-15 (1), 16-23 (2), 24-31 (3).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* p) {
#if __CUDA_ARCH__ >= 750
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
#else
    __trap();
#endif
}

// Four 8x8 16-bit matrices: rows are given by lanes 0-7 (matrix 0), 8-15
// (1), 16-23 (2), 24-31 (3); lane l receives row l / 4, columns 2(l % 4) and
// 2(l % 4) + 1 of each.
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const u16* p) {
#if __CUDA_ARCH__ >= 750
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
#else
    __trap();
#endif
}

// This lane's row address, relative to a 16 x 16 block of a tile with row
// stride LD, for ldmatrix_x4_trans reading B fragments of a [k][n] tile:
// b[0], b[1] of columns 0-7 and b[2], b[3] of columns 8-15.
template <int LD> __device__ __forceinline__ int lm_trans_off(int lane) {
    return ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
}

// This lane's row address, relative to a 16 x 16 block of a tile with row
// stride LD, for ldmatrix_x4 reading B fragments of an [n][k] tile (b[0],
// b[1] of rows 0-7 and b[2], b[3] of rows 8-15), or, with ldmatrix_x4_trans,
// the A fragment of the transpose of a [k][m] tile.
template <int LD> __device__ __forceinline__ int lm_off(int lane) {
    return ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
}

__device__ __forceinline__ u32 lds32(const u16* p) { return *reinterpret_cast<const u32*>(p); }

// The 16-bit types' m16n8k16 product (f32 accumulation) and packing.
template <typename T> struct Cvt16;
#if __CUDA_ARCH__ >= 800
#define CVT16_POLICY(T, TY)                                                                                   \
    template <> struct Cvt16<T> {                                                                             \
        static __device__ __forceinline__ void mma(float c[4], const u32 a[4], u32 b0, u32 b1) {               \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, "             \
                         "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                               \
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                       \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                       \
        }                                                                                                     \
        /* Two f32 values as one register of two 16-bit values (lo in the low half). */                       \
        static __device__ __forceinline__ u32 pack(float lo, float hi) {                                      \
            u32 r;                                                                                            \
            asm("cvt.rn." TY "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                               \
            return r;                                                                                         \
        }                                                                                                     \
    };
#else
#define CVT16_POLICY(T, TY)                                                                                   \
    template <> struct Cvt16<T> {                                                                             \
        static __device__ __forceinline__ void mma(float*, const u32*, u32, u32) { __trap(); }                \
        static __device__ __forceinline__ u32 pack(float, float) {                                            \
            __trap();                                                                                         \
            return 0;                                                                                         \
        }                                                                                                     \
    };
#endif
CVT16_POLICY(Bf16, "bf16")
CVT16_POLICY(F16, "f16")

// The fragment policy of the tensor-core kernels. Every 16 x 16 block is
// addressed by a pointer to its first element in a tile of row stride LD:
//   load_a    the A fragment of a row-major [m][k] block;
//   load_a_t  the A fragment of the transpose of a [k][m] block;
//   load_b    the B fragments (columns 0-7, 8-15) of the transpose of an [n][k] block;
//   load_b_t  the B fragments of a [k][n] block;
//   pack_a    the A fragment of the block held by two adjacent C tiles;
//   store_a   an A fragment back into a row-major block;
//   mma2      c0 += A B[:, 0:8], c1 += A B[:, 8:16];
//   store2    two adjacent output values.
template <typename T> struct Frag {
    typedef u16 E;
    struct A { u32 r[4]; };
    struct B { u32 r[4]; };
    template <int LD> static __device__ __forceinline__ void load_a(A& a, const E* p, int lane) {
        const E* base = p + (lane / 4) * LD + 2 * (lane % 4);
        a.r[0] = lds32(base);
        a.r[1] = lds32(base + 8 * LD);
        a.r[2] = lds32(base + 8);
        a.r[3] = lds32(base + 8 * LD + 8);
    }
    template <int LD> static __device__ __forceinline__ void load_a_t(A& a, const E* p, int lane) {
        ldmatrix_x4_trans(a.r, p + lm_off<LD>(lane));
    }
    template <int LD> static __device__ __forceinline__ void load_b(B& b, const E* p, int lane) {
        ldmatrix_x4(b.r, p + lm_off<LD>(lane));
    }
    template <int LD> static __device__ __forceinline__ void load_b_t(B& b, const E* p, int lane) {
        ldmatrix_x4_trans(b.r, p + lm_trans_off<LD>(lane));
    }
    static __device__ __forceinline__ void pack_a(A& a, const float c0[4], const float c1[4]) {
        a.r[0] = Cvt16<T>::pack(c0[0], c0[1]);
        a.r[1] = Cvt16<T>::pack(c0[2], c0[3]);
        a.r[2] = Cvt16<T>::pack(c1[0], c1[1]);
        a.r[3] = Cvt16<T>::pack(c1[2], c1[3]);
    }
    template <int LD> static __device__ __forceinline__ void store_a(E* p, const A& a, int lane) {
        E* row = p + (lane / 4) * LD + 2 * (lane % 4);
        *reinterpret_cast<u32*>(row) = a.r[0];
        *reinterpret_cast<u32*>(row + 8 * LD) = a.r[1];
        *reinterpret_cast<u32*>(row + 8) = a.r[2];
        *reinterpret_cast<u32*>(row + 8 * LD + 8) = a.r[3];
    }
    static __device__ __forceinline__ void mma2(float c0[4], float c1[4], const A& a, const B& b) {
        Cvt16<T>::mma(c0, a.r, b.r[0], b.r[1]);
        Cvt16<T>::mma(c1, a.r, b.r[2], b.r[3]);
    }
    static __device__ __forceinline__ void store2(T* p, float x0, float x1) {
        *reinterpret_cast<u32*>(p) = Cvt16<T>::pack(x0, x1);
    }
};

struct __align__(8) F2 { float x, y; };

template <> struct Frag<float> {
    typedef float E;
    // Per k = 8 half h: the tf32 parts (hi) and remainders (lo).
    struct A { u32 hi[2][4], lo[2][4]; };
    // Per column half j and k half h.
    struct B { u32 hi[2][2][2], lo[2][2][2]; };
    static __device__ __forceinline__ void split(float x, u32& hi, u32& lo) {
#if __CUDA_ARCH__ >= 800
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
#else
        hi = lo = 0;
        __trap();
#endif
    }
    // Slots a0..a3 of half h: (g, 2t), (g + 8, 2t), (g, 2t + 1), (g + 8, 2t + 1).
    static __device__ __forceinline__ void set_a(A& a, int h, float x0, float x1, float x2, float x3) {
        split(x0, a.hi[h][0], a.lo[h][0]);
        split(x1, a.hi[h][1], a.lo[h][1]);
        split(x2, a.hi[h][2], a.lo[h][2]);
        split(x3, a.hi[h][3], a.lo[h][3]);
    }
    template <int LD> static __device__ __forceinline__ void load_a(A& a, const E* p, int lane) {
        const E* base = p + (lane / 4) * LD + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const F2 u = *reinterpret_cast<const F2*>(base + 8 * h);
            const F2 w = *reinterpret_cast<const F2*>(base + 8 * LD + 8 * h);
            set_a(a, h, u.x, w.x, u.y, w.y);
        }
    }
    template <int LD> static __device__ __forceinline__ void load_a_t(A& a, const E* p, int lane) {
        const E* base = p + 2 * (lane % 4) * LD + lane / 4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const E* r = base + 8 * h * LD;
            set_a(a, h, r[0], r[8], r[LD], r[LD + 8]);
        }
    }
    template <int LD> static __device__ __forceinline__ void load_b(B& b, const E* p, int lane) {
        const E* base = p + (lane / 4) * LD + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const F2 u = *reinterpret_cast<const F2*>(base + 8 * j * LD + 8 * h);
                split(u.x, b.hi[j][h][0], b.lo[j][h][0]);
                split(u.y, b.hi[j][h][1], b.lo[j][h][1]);
            }
    }
    template <int LD> static __device__ __forceinline__ void load_b_t(B& b, const E* p, int lane) {
        const E* base = p + 2 * (lane % 4) * LD + lane / 4;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const E* r = base + 8 * h * LD + 8 * j;
                split(r[0], b.hi[j][h][0], b.lo[j][h][0]);
                split(r[LD], b.hi[j][h][1], b.lo[j][h][1]);
            }
    }
    static __device__ __forceinline__ void pack_a(A& a, const float c0[4], const float c1[4]) {
        set_a(a, 0, c0[0], c0[2], c0[1], c0[3]);
        set_a(a, 1, c1[0], c1[2], c1[1], c1[3]);
    }
    template <int LD> static __device__ __forceinline__ void store_a(E* p, const A& a, int lane) {
        E* base = p + (lane / 4) * LD + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = __uint_as_float(a.hi[h][e]) + __uint_as_float(a.lo[h][e]);
            *reinterpret_cast<F2*>(base + 8 * h) = F2{x[0], x[2]};
            *reinterpret_cast<F2*>(base + 8 * LD + 8 * h) = F2{x[1], x[3]};
        }
    }
    static __device__ __forceinline__ void mma(float c[4], const u32 a[4], const u32 b[2]) {
#if __CUDA_ARCH__ >= 800
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
        __trap();
#endif
    }
    static __device__ __forceinline__ void mma2(float c0[4], float c1[4], const A& a, const B& b) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float* c = j ? c1 : c0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                mma(c, a.lo[h], b.hi[j][h]);
                mma(c, a.hi[h], b.lo[j][h]);
                mma(c, a.hi[h], b.hi[j][h]);
            }
        }
    }
    static __device__ __forceinline__ void store2(float* p, float x0, float x1) {
        *reinterpret_cast<F2*>(p) = F2{x0, x1};
    }
};

// 2^x with the hardware approximation (2 ulp; -inf gives 0).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 16 bytes from global to shared memory without waiting; zeros when !ok.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0));
#else
    __trap();
#endif
}
// 4 bytes likewise (zeros when !ok).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 4 : 0));
#else
    __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}
// Waits until at most N of this thread's committed copy groups are in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}

// Loads rows r0 .. r0+R-1 of a row-major [rows, d] matrix into a [R][D+8]
// tile, zero outside. With `vec` (d % 8 == 0 and an aligned base) as
// asynchronous 16-byte copies: the caller commits them as a group and waits
// (cp_async_wait) before a barrier; otherwise with plain loads and stores.
template <int R, int D, typename E>
__device__ __forceinline__ void load_tile(E* tile, const E* src, int r0, int rows, int d, int vec) {
    const int LD = D + MPAD;
    if (vec) {
        const int W = 16 / sizeof(E), CH = D / W;
        for (int idx = threadIdx.x; idx < R * CH; idx += blockDim.x) {
            const int r = idx / CH, c = (idx % CH) * W;
            const bool ok = r0 + r < rows && c < d;
            cp_async16(tile + r * LD + c, ok ? src + (i64)(r0 + r) * d + c : src, ok);
        }
    } else {
        for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
            const int r = idx / D, c = idx % D;
            tile[r * LD + c] = (r0 + r < rows && c < d) ? src[(i64)(r0 + r) * d + c] : (E)0;
        }
    }
}

// dst[0..3] += (a, b, c, d) in global memory, atomically; `left` columns
// remain in the row from dst on (one vector reduction when all four are in
// and `vec`: dst 16-byte aligned).
__device__ __forceinline__ void red_add4(float* dst, int left, bool vec, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    if (vec && left >= 4) {
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
                     : "memory");
        return;
    }
#endif
    if (left > 0) atomicAdd(dst, a);
    if (left > 1) atomicAdd(dst + 1, b);
    if (left > 2) atomicAdd(dst + 2, c);
    if (left > 3) atomicAdd(dst + 3, d);
}

// acc[row0 + r][col0 + c] += mul * frags (N C tiles side by side: 16 rows
// from row0, 8 N columns from col0) of an f32 [rows, d] matrix, atomically.
// Lanes t and t ^ 1 swap halves so that each adds four adjacent columns of
// one row: even t row g, odd t row g + 8.
template <int N>
__device__ __forceinline__ void red_add_frags(float* acc, int row0, int rows, int col0, int d,
                                              const float frags[N][4], float mul, int lane) {
    const int g = lane / 4, t = lane % 4, r = t & 1, i = row0 + g + r * 8;
    float x[N][4];
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const float x0 = frags[n][0] * mul, x1 = frags[n][1] * mul;
        const float x2 = frags[n][2] * mul, x3 = frags[n][3] * mul;
        const float y0 = __shfl_xor_sync(0xffffffffu, r ? x0 : x2, 1);
        const float y1 = __shfl_xor_sync(0xffffffffu, r ? x1 : x3, 1);
        x[n][0] = r ? y0 : x0;
        x[n][1] = r ? y1 : x1;
        x[n][2] = r ? x2 : y0;
        x[n][3] = r ? x3 : y1;
    }
    if (i >= rows) return;
    const int c0 = col0 + 2 * (t & ~1);
    float* row = acc + (i64)i * d + c0;
    const bool vec = (reinterpret_cast<size_t>(row) & 15) == 0 && (d & 3) == 0;
#pragma unroll
    for (int n = 0; n < N; ++n) red_add4(row + n * 8, d - c0 - n * 8, vec, x[n][0], x[n][1], x[n][2], x[n][3]);
}

// Stores a row-major fragment row (two values at columns col, col+1) of a [.., d] matrix.
template <typename T>
__device__ __forceinline__ void store_pair(T* row, int col, int d, float x0, float x1) {
    if (col + 1 < d) {
        if ((d & 1) == 0) {
            Frag<T>::store2(row + col, x0, x1);
        } else {
            row[col] = from_f32<T>(x0);
            row[col + 1] = from_f32<T>(x1);
        }
    } else if (col < d) {
        row[col] = from_f32<T>(x0);
    }
}

// The forward's masking, a pass of its own so that the softmax after it has
// no branches: scores of a thread's two fragment rows (row_a, row_a + 8) and
// keys j0 + 8n + 2t (+1) that the row may not see become -inf.
__device__ __forceinline__ void mask_tile(float (&s)[8][4], const Params& p, const RowMask& mask_row, int row_a, int j0,
                                          int t) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!visible(p, mask_row, row_a + (e >> 1) * 8, j0 + n * 8 + 2 * t + (e & 1))) s[n][e] = NEG_INF;
}

// One key tile's step of the online softmax for a thread's two fragment rows
// (g and g + 8 of its 16): the scores s (-inf where masked) are scaled by
// sl2 = scale * log2(e) > 0 and become the tile's unnormalised probabilities
// exp2(s sl2 - m), and their sum is added to l. The running max m moves (and
// l and the output accumulator acc are rescaled to it) only when a row of
// the warp sees a score above m + 8: below that, probabilities stay under
// 2^8, which f32 sums and 16-bit P carry as well as values under 1, and the
// tiles of a long row mostly skip the rescaling (FlashAttention-4's trick).
template <int NO>
__device__ __forceinline__ void softmax_tile(float (&s)[8][4], float (&acc)[NO][4], float (&m)[2], float (&l)[2],
                                             float sl2) {
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        mx[r] *= sl2;  // sl2 > 0
    }
    if (__any_sync(0xffffffffu, mx[0] > m[0] + 8.f || mx[1] > m[1] + 8.f)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m_new = fmaxf(m[r], mx[r]);
            const float alpha = fast_exp2(m[r] - (m_new == NEG_INF ? 0.f : m_new));
            m[r] = m_new;
            l[r] *= alpha;
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                acc[n][2 * r] *= alpha;
                acc[n][2 * r + 1] *= alpha;
            }
        }
    }
    const float m_use[2] = {m[0] == NEG_INF ? 0.f : m[0], m[1] == NEG_INF ? 0.f : m[1]};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[n][e] = fast_exp2(fmaf(s[n][e], sl2, -m_use[e >> 1]));
            l[e >> 1] += s[n][e];
        }
}

// Writes a thread's two output rows (row_a and row_a + 8 of head bh: acc over
// the row sums of l, whose other parts lanes t ^ 1 and t ^ 2 hold) and their
// log-sum-exp (zeros and -inf for a row that sees no key).
template <typename T, int NO>
__device__ __forceinline__ void store_rows(const float (&acc)[NO][4], const float (&m)[2], const float (&l)[2], T* o,
                                           float* lse, const Params& p, i64 bh, int row_a, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int i = row_a + r * 8;
        if (i >= p.s_q) continue;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        T* orow = o + (bh * p.s_q + i) * p.d;
#pragma unroll
        for (int n = 0; n < NO; ++n)
            store_pair<T>(orow, n * 8 + 2 * t, p.d, acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
        if (t == 0) lse[bh * p.s_q + i] = sum > 0.f ? (m[r] + log2f(sum)) * LN2 : NEG_INF;
    }
}

// The forward of one tile of 64 * RG queries: warp w owns rows
// 16 * RG * w .. 16 * RG * (w + 1) - 1 as RG groups of 16, which share every
// key and value fragment loaded from shared memory.
template <typename T, int D, int RG>
__device__ void fwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        T* __restrict__ o, float* __restrict__ lse, const u8* __restrict__ keep,
                        const u32* __restrict__ start, Params p, int vec) {
    typedef Frag<T> M;
    typedef typename M::E E;
    constexpr int LD = D + MPAD, KS = D / 16, NO = D / 8, BM = MB * RG;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    E* Qs = reinterpret_cast<E*>(tc_smem);
    E* Kb = Qs + BM * LD;      // two K tiles
    E* Vb = Kb + 2 * MB * LD;  // two V tiles
    const int bh = block_head();
    const int tiles = (p.s_q + BM - 1) / BM;
    const int i0 = (tiles - 1 - (int)blockIdx.x) * BM;
    const int bb = bh / p.heads, h = bh % p.heads;
    const int kvh = h / (p.heads / p.kv_heads);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const E* kh = reinterpret_cast<const E*>(k) + ((i64)bb * p.kv_heads + kvh) * p.s_k * p.d;
    const E* vh = reinterpret_cast<const E*>(v) + ((i64)bb * p.kv_heads + kvh) * p.s_k * p.d;
    const RowMask mask_row = row_mask(p, keep, start, bb);
    const float sl2 = p.scale * LOG2E;

    const int last = min(i0 + BM, p.s_q) - 1;
    const int kend = key_end(p, last);
    load_tile<BM, D>(Qs, reinterpret_cast<const E*>(q) + (i64)bh * p.s_q * p.d, i0, p.s_q, p.d, vec);
    if (kend > 0) {
        load_tile<MB, D>(Kb, kh, 0, p.s_k, p.d, vec);
        load_tile<MB, D>(Vb, vh, 0, p.s_k, p.d, vec);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    typename M::A qa[RG][KS];
#pragma unroll
    for (int rg = 0; rg < RG; ++rg)
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
            M::template load_a<LD>(qa[rg][kk], Qs + (warp * RG + rg) * 16 * LD + kk * 16, lane);

    float acc[RG][NO][4];
    float m[RG][2], l[RG][2];
#pragma unroll
    for (int rg = 0; rg < RG; ++rg) {
#pragma unroll
        for (int n = 0; n < NO; ++n) acc[rg][n][0] = acc[rg][n][1] = acc[rg][n][2] = acc[rg][n][3] = 0.f;
        m[rg][0] = m[rg][1] = NEG_INF;
        l[rg][0] = l[rg][1] = 0.f;
    }
    // This thread's rows: row_a + 16 * rg and row_a + 16 * rg + 8.
    const int row_a = i0 + warp * 16 * RG + g;
    // Key tiles from `full_end` on may hide keys from some rows of the block.
    const int full_end = p.has_keep || p.has_start ? 0 : key_end(p, i0);
    for (int j0 = 0, it = 0; j0 < kend; j0 += MB, ++it) {
        // Fetch the next key tile while this one is used (the barrier at the
        // end of the last iteration freed its buffer).
        const E* Ks = Kb + (it & 1) * MB * LD;
        const E* Vs = Vb + (it & 1) * MB * LD;
        if (j0 + MB < kend) {
            load_tile<MB, D>(Kb + ((it + 1) & 1) * MB * LD, kh, j0 + MB, p.s_k, p.d, vec);
            load_tile<MB, D>(Vb + ((it + 1) & 1) * MB * LD, vh, j0 + MB, p.s_k, p.d, vec);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        float s[RG][8][4];
#pragma unroll
        for (int rg = 0; rg < RG; ++rg)
#pragma unroll
            for (int n = 0; n < 8; ++n) s[rg][n][0] = s[rg][n][1] = s[rg][n][2] = s[rg][n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                typename M::B b;
                M::template load_b<LD>(b, Ks + np * 16 * LD + kk * 16, lane);
#pragma unroll
                for (int rg = 0; rg < RG; ++rg) M::mma2(s[rg][2 * np], s[rg][2 * np + 1], qa[rg][kk], b);
            }
        }
        if (j0 + MB > full_end) {
#pragma unroll
            for (int rg = 0; rg < RG; ++rg) mask_tile(s[rg], p, mask_row, row_a + rg * 16, j0, t);
        }
#pragma unroll
        for (int rg = 0; rg < RG; ++rg) softmax_tile<NO>(s[rg], acc[rg], m[rg], l[rg], sl2);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            typename M::A pa[RG];
#pragma unroll
            for (int rg = 0; rg < RG; ++rg) M::pack_a(pa[rg], s[rg][2 * kk], s[rg][2 * kk + 1]);
#pragma unroll
            for (int n2 = 0; n2 < D / 16; ++n2) {
                typename M::B b;
                M::template load_b_t<LD>(b, Vs + kk * 16 * LD + n2 * 16, lane);
#pragma unroll
                for (int rg = 0; rg < RG; ++rg) M::mma2(acc[rg][2 * n2], acc[rg][2 * n2 + 1], pa[rg], b);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int rg = 0; rg < RG; ++rg) store_rows<T, NO>(acc[rg], m[rg], l[rg], o, lse, p, bh, row_a + rg * 16, t);
}

// The backward kernels' walk over query tiles: tile `it` of a block's
// sequence is tile it % nq of query head it / nq of the block's share of the
// group (no division without grouped-query heads): that head's index in the
// share, and the tile's first row (tiles of R rows from qstart).
template <int R>
__device__ __forceinline__ int2 query_tile(int it, int nq, int share, int qstart) {
    const int h = share == 1 ? 0 : it / nq;
    return make_int2(h, qstart + (it - h * nq) * R);
}

// The backward kernels' shared steps. Rows of a query tile: lse into Ls and
// delta into Es, for rows i0 .. i0 + R - 1 of head bh, as asynchronous copies
// in the caller's group (zeros past the end: such rows are in masked tiles).
template <int R>
__device__ __forceinline__ void load_rows(float* Ls, float* Es, const float* __restrict__ lse,
                                          const float* __restrict__ delta, i64 bh, int i0, int s_q) {
    for (int r = threadIdx.x; r < 2 * R; r += blockDim.x) {
        const int i = i0 + r % R;
        const bool ok = i < s_q;
        cp_async4((r < R ? Ls : Es) + r % R, (r < R ? lse : delta) + bh * s_q + (ok ? i : 0), ok);
    }
}

// P^T (into s) and dS^T = P^T * (dP^T - delta) (into dp); masked entries and
// rows that see no key give 0. MASKED = false (a tile that hides no entry)
// has no branches, so that the tile's exponentials overlap.
template <int N, bool MASKED>
__device__ __forceinline__ void probs_and_ds_tile(float (&s)[N][4], float (&dp)[N][4], const float* Ls,
                                                  const float* Es, const Params& p, const RowMask& mask_row, int i0,
                                                  int key_a, int t) {
    const float sl2 = p.scale * LOG2E;
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const float2 ls = *reinterpret_cast<const float2*>(Ls + n * 8 + 2 * t);
        const float2 es = *reinterpret_cast<const float2*>(Es + n * 8 + 2 * t);
        const float l2[2] = {-ls.x * LOG2E, -ls.y * LOG2E};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            // A row that sees no key (lse = -inf) is in a masked tile.
            float pe = fast_exp2(fmaf(s[n][e], sl2, l2[e & 1]));
            if (MASKED && !visible(p, mask_row, i0 + n * 8 + 2 * t + (e & 1), key_a + (e >> 1) * 8)) pe = 0.f;
            s[n][e] = pe;
            dp[n][e] = pe * (dp[n][e] - (e & 1 ? es.y : es.x));
        }
    }
}

template <int N>
__device__ __forceinline__ void probs_and_ds(float (&s)[N][4], float (&dp)[N][4], const float* Ls, const float* Es,
                                             const Params& p, const RowMask& mask_row, bool masked, int i0, int key_a,
                                             int t) {
    if (masked)
        probs_and_ds_tile<N, true>(s, dp, Ls, Es, p, mask_row, i0, key_a, t);
    else
        probs_and_ds_tile<N, false>(s, dp, Ls, Es, p, mask_row, i0, key_a, t);
}

// Writes a warp's dK and dV (16 keys from key0, N column chunks of 8) of
// key/value head bkv: into dk and dv, or with kv_splits > 1 added to the f32
// accumulators dkv_acc (dK then dV).
template <typename T, int N>
__device__ __forceinline__ void store_dkdv(const float (&gk)[N][4], const float (&gv)[N][4], T* dk, T* dv,
                                           float* dkv_acc, const Params& p, int bkv, int key0, int lane) {
    if (p.kv_splits > 1) {
        const i64 n = (i64)p.b * p.kv_heads * p.s_k * p.d;
        float* kacc = dkv_acc + (i64)bkv * p.s_k * p.d;
        red_add_frags<N>(kacc, key0, p.s_k, 0, p.d, gk, p.scale, lane);
        red_add_frags<N>(kacc + n, key0, p.s_k, 0, p.d, gv, 1.f, lane);
        return;
    }
    const int t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = key0 + lane / 4 + r * 8;
        if (j >= p.s_k) continue;
        T* krow = dk + ((i64)bkv * p.s_k + j) * p.d;
        T* vrow = dv + ((i64)bkv * p.s_k + j) * p.d;
#pragma unroll
        for (int n = 0; n < N; ++n) {
            store_pair<T>(krow, n * 8 + 2 * t, p.d, gk[n][2 * r] * p.scale, gk[n][2 * r + 1] * p.scale);
            store_pair<T>(vrow, n * 8 + 2 * t, p.d, gv[n][2 * r], gv[n][2 * r + 1]);
        }
    }
}

// The backward of one 64-key tile (FlashAttention-2's scheme, five products
// per tile pair): dK and dV summed over the query heads of the key head's
// group (or their share of them, see Params::kv_splits), whose query tiles
// of BQ rows go by; for each, dS (transposed) goes through shared memory to
// dQ = dS K, which the block adds to the f32 accumulator `dq_acc`
// [b, heads, s_q, d] with atomics. With kv_splits > 1, dK and dV are added to
// the f32 accumulators `dkv_acc` (dK then dV, each [b, kv_heads, s_k, d]).
template <typename T, int D, int BQ>
__device__ void bwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const T* __restrict__ dout, const float* __restrict__ lse,
                        const float* __restrict__ delta, const u8* __restrict__ keep, const u32* __restrict__ start,
                        T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc, float* __restrict__ dkv_acc,
                        Params p, int vec) {
    // MB keys per block, 16 per warp.
    constexpr int LD = D + MPAD, KS = D / 16, NO = D / 8, NQ = BQ / 8, LDS = BQ + MPAD;
    // dQ = dS K: the four warps as QW groups of 16 queries times DW groups of columns.
    constexpr int QW = BQ / 16, DW = 4 / QW, NT = NO / DW;
    static_assert(QW * DW == 4 && NT % 2 == 0, "dQ warp layout");
    typedef Frag<T> M;
    typedef typename M::E E;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    E* Ks = reinterpret_cast<E*>(tc_smem);
    E* Vs = Ks + MB * LD;
    E* Qb = Vs + MB * LD;       // two Q tiles
    E* Db = Qb + 2 * BQ * LD;   // two dO tiles
    E* Ss = Db + 2 * BQ * LD;   // dS transposed: [key][query]
    float* Lb = reinterpret_cast<float*>(Ss + MB * LDS);  // two lse * log2(e) rows
    float* Eb = Lb + 2 * BQ;      // two delta rows
    const int bkv = block_head() / p.kv_splits, part = block_head() % p.kv_splits;
    const int j0 = blockIdx.x * MB;
    const int bb = bkv / p.kv_heads, kvh = bkv % p.kv_heads;
    const int group = p.heads / p.kv_heads, share = group / p.kv_splits;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const RowMask mask_row = row_mask(p, keep, start, bb);
    load_tile<MB, D>(Ks, reinterpret_cast<const E*>(k) + (i64)bkv * p.s_k * p.d, j0, p.s_k, p.d, vec);
    load_tile<MB, D>(Vs, reinterpret_cast<const E*>(v) + (i64)bkv * p.s_k * p.d, j0, p.s_k, p.d, vec);
    float gk[NO][4], gv[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) gk[n][e] = gv[n][e] = 0.f;
    const int key_a = j0 + warp * 16 + g;  // this thread's keys: key_a, key_a + 8
    const int qstart = (first_query(p, j0) / BQ) * BQ;
    // Query tiles from `full_from` on see every key of this tile.
    const int full_from = first_query(p, j0 + MB - 1);
    // The (query head of the group, query tile) pairs, in one sequence whose
    // next tiles are fetched while the current ones are used.
    const int nq = qstart < p.s_q ? (p.s_q - qstart + BQ - 1) / BQ : 0;
    const int total = share * nq;
    auto head_of = [&](int it) {
        return (i64)bb * p.heads + kvh * group + part * share + query_tile<BQ>(it, nq, share, qstart).x;
    };
    auto fetch = [&](int it, int buf) {
        const i64 bh = head_of(it);
        const int i0 = query_tile<BQ>(it, nq, share, qstart).y;
        load_tile<BQ, D>(Qb + buf * BQ * LD, reinterpret_cast<const E*>(q) + bh * p.s_q * p.d, i0, p.s_q, p.d, vec);
        load_tile<BQ, D>(Db + buf * BQ * LD, reinterpret_cast<const E*>(dout) + bh * p.s_q * p.d, i0, p.s_q, p.d,
                         vec);
        load_rows<BQ>(Lb + buf * BQ, Eb + buf * BQ, lse, delta, bh, i0, p.s_q);
    };
    if (total > 0) fetch(0, 0);
    cp_async_commit();
    const int qg = warp % QW, dg = warp / QW;
    for (int it = 0; it < total; ++it) {
        const int i0 = query_tile<BQ>(it, nq, share, qstart).y;
        const E* Qs = Qb + (it & 1) * BQ * LD;
        const E* Ds = Db + (it & 1) * BQ * LD;
        const float* Ls = Lb + (it & 1) * BQ;
        const float* Es = Eb + (it & 1) * BQ;
        if (it + 1 < total) fetch(it + 1, (it + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys.
        float s[NQ][4], dp[NQ][4];
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            typename M::A ka, va;
            M::template load_a<LD>(ka, Ks + warp * 16 * LD + kk * 16, lane);
            M::template load_a<LD>(va, Vs + warp * 16 * LD + kk * 16, lane);
#pragma unroll
            for (int np = 0; np < NQ / 2; ++np) {
                typename M::B bq, bd;
                M::template load_b<LD>(bq, Qs + np * 16 * LD + kk * 16, lane);
                M::template load_b<LD>(bd, Ds + np * 16 * LD + kk * 16, lane);
                M::mma2(s[2 * np], s[2 * np + 1], ka, bq);
                M::mma2(dp[2 * np], dp[2 * np + 1], va, bd);
            }
        }
        const bool masked = p.has_keep || p.has_start || i0 < full_from || i0 + BQ > p.s_q || j0 + MB > p.s_k;
        probs_and_ds<NQ>(s, dp, Ls, Es, p, mask_row, masked, i0, key_a, t);
        // dV += P^T dO, dK += dS^T Q; dS^T to shared memory for dQ.
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
            typename M::A pa, sa;
            M::pack_a(pa, s[2 * kk], s[2 * kk + 1]);
            M::pack_a(sa, dp[2 * kk], dp[2 * kk + 1]);
            M::template store_a<LDS>(Ss + warp * 16 * LDS + kk * 16, sa, lane);
#pragma unroll
            for (int n2 = 0; n2 < D / 16; ++n2) {
                typename M::B b;
                M::template load_b_t<LD>(b, Ds + kk * 16 * LD + n2 * 16, lane);
                M::mma2(gv[2 * n2], gv[2 * n2 + 1], pa, b);
                M::template load_b_t<LD>(b, Qs + kk * 16 * LD + n2 * 16, lane);
                M::mma2(gk[2 * n2], gk[2 * n2 + 1], sa, b);
            }
        }
        __syncthreads();
        // dQ of queries qg*16 .. +15, columns dg*NT*8 .. +NT*8-1, over the tile's MB keys.
        {
            float gq[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n) gq[n][0] = gq[n][1] = gq[n][2] = gq[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < MB / 16; ++kk) {
                typename M::A a;
                M::template load_a_t<LDS>(a, Ss + kk * 16 * LDS + qg * 16, lane);
#pragma unroll
                for (int n2 = 0; n2 < NT / 2; ++n2) {
                    typename M::B b;
                    M::template load_b_t<LD>(b, Ks + kk * 16 * LD + dg * NT * 8 + n2 * 16, lane);
                    M::mma2(gq[2 * n2], gq[2 * n2 + 1], a, b);
                }
            }
            red_add_frags<NT>(dq_acc + head_of(it) * p.s_q * p.d, i0 + qg * 16, p.s_q, dg * NT * 8, p.d, gq, p.scale,
                              lane);
        }
        __syncthreads();
    }
    store_dkdv<T, NO>(gk, gv, dk, dv, dkv_acc, p, bkv, j0 + warp * 16, lane);
}

// ===========================================================================
// Warpgroup kernels (Hopper, compute_90a: `wgmma.mma_async`, f32
// accumulation) for 16-bit inputs and d <= 64: the backward of a tile of
// 64 keys per warpgroup, query tiles of 64 rows. Tiles live in shared memory
// as rows of 64 elements (128 bytes) with the 128-byte swizzle (`swz`: the
// 16-byte chunks of row r permuted by r % 8, tiles 1024-byte aligned), which
// wgmma reads without bank conflicts and as either operand order: a tile is a
// K-major operand when its columns are the reduction and an MN-major one
// when its rows are. Per query tile:
//   S^T = K Q^T, dP^T = V dO^T   A: K, V fragments held in registers
//   dV += P^T dO, dK += dS^T Q    A: P^T, dS^T from the accumulators
//   dQ = dS K                     A: dS^T stored to shared memory
// then dQ is added to the f32 accumulator as in bwd_mma.

#define WG 64     // keys per warpgroup, queries per tile, columns (d <= 64)

// Element index of (r, c) in a swizzled tile of 64-element rows.
__device__ __forceinline__ int swz(int r, int c) { return (r << 6) + (((c >> 3) ^ (r & 7)) << 3) + (c & 7); }

#define WG_THREADS 256  // threads of a warpgroup kernel's block

// Loads rows r0 .. r0+R-1 (columns 0 .. 63) of a row-major [rows, d] matrix
// into a swizzled [R][64] tile with asynchronous 16-byte copies, zero outside
// (d % 8 == 0). Thread x copies chunk x % 8 of rows x / 8, x / 8 + 32, ...:
// the same swizzled column in each.
template <int R, typename E>
__device__ __forceinline__ void load_swz(E* tile, const E* src, int r0, int rows, int d) {
    constexpr int STEP = WG_THREADS / 8;
    static_assert(R % STEP == 0 && STEP % 8 == 0, "rows per pass");
    const int r = threadIdx.x / 8, cc = threadIdx.x % 8, c = cc * 8;
    E* dst = tile + (r << 6) + ((cc ^ (r & 7)) << 3);
    src += (i64)r0 * d + c;
#pragma unroll
    for (int k = 0; k < R / STEP; ++k) {
        const int rr = r + k * STEP;
        const bool ok = r0 + rr < rows && c < d;
        cp_async16(dst + k * STEP * 64, ok ? src + rr * d : src, ok);
    }
}

// The thread's warpgroup, broadcast from lane 0 so that the compiler knows
// it is the same across the warp (descriptors built from it stay in uniform
// registers).
__device__ __forceinline__ int warpgroup() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }

// Stores four 8 x 8 matrices of 16-bit elements from A-fragment registers
// (r[0] rows 0-7 / columns 0-7, r[1] rows 8-15, r[2] columns 8-15, r[3] both)
// of a 16 x 16 block at rows r0.., columns c0.. (c0 % 8 == 0) of a swizzled tile.
__device__ __forceinline__ void stmatrix_swz(u16* tile, int r0, int c0, const u32 r[4], int lane) {
#if __CUDA_ARCH__ >= 900
    const int m = lane / 8, row = r0 + lane % 8 + (m & 1) * 8, col = c0 + (m >> 1) * 8;
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                     smem_addr(tile + swz(row, col))),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#else
    __trap();
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_OK 1

// Shared memory descriptor of an operand starting at p in a swizzled tile:
// 128-byte swizzle, 1024 bytes between groups of 8 rows (the leading offset
// is unused: every operand spans at most one 64-element row).
__device__ __forceinline__ unsigned long long wg_desc(const void* p) {
    return (unsigned long long)((smem_addr(p) & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
// The descriptor of the operand `e` 16-bit elements on from the one that d
// describes, in the same tile (the start address is in 16-byte units in the
// low bits, which the tile's offsets never carry out of): computed once per
// tile, a descriptor then costs one addition per wgmma.
__device__ __forceinline__ unsigned long long wg_at(unsigned long long d, int e) { return d + (unsigned)(e >> 3); }

__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Shared memory written by ordinary stores or cp.async, read next by wgmma.
__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Keeps the compiler from moving uses of accumulators across a wait.
template <int N> __device__ __forceinline__ void wg_pin(float (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e])::"memory");
}

#define WG_D32(d)                                                                                             \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),   \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]),             \
        "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]),             \
        "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]),             \
        "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define WG_REGS32                                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "    \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

#define WG_D16(d)                                                                                             \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),   \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]),             \
        "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define WG_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

template <typename T> struct Wg;
#define WG_POLICY(T, TY)                                                                                      \
    template <> struct Wg<T> {                                                                                \
        /* d (64 x 64) = (acc ? d : 0) + A B, A (64 x 16) from registers, B (16 x 64) from the   */          \
        /* descriptor `b`, K-major (TB = 0) or N-major (TB = 1).                                     */          \
        template <int TB>                                                                                     \
        static __device__ __forceinline__ void rs(float (&d)[8][4], const u32 a[4], unsigned long long b, int acc) { \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %38, 0;\n"                                           \
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " WG_REGS32                 \
                         ", {%32, %33, %34, %35}, %36, p, 1, 1, %37; }"                                       \
                         : WG_D32(d)                                                                          \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB), "r"(acc));            \
        }                                                                                                     \
        /* d (64 x 32) = (acc ? d : 0) + A B, both from shared memory: A K-major (TA = 0) or     */          \
        /* M-major (TA = 1), B as in rs.                                                             */          \
        template <int TA, int TB>                                                                             \
        static __device__ __forceinline__ void ss(float (&d)[4][4], unsigned long long a, unsigned long long b, int acc) { \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %20, 0;\n"                                           \
                         "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " WG_REGS16                 \
                         ", %16, %17, p, 1, 1, %18, %19; }"                                                   \
                         : WG_D16(d)                                                                          \
                         : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(acc));                                       \
        }                                                                                                     \
        /* As ss, 64 columns.                                                                        */          \
        template <int TA, int TB>                                                                             \
        static __device__ __forceinline__ void ss64(float (&d)[8][4], unsigned long long a, unsigned long long b, int acc) { \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %36, 0;\n"                                           \
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " WG_REGS32                 \
                         ", %32, %33, p, 1, 1, %34, %35; }"                                                   \
                         : WG_D32(d)                                                                          \
                         : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(acc));                                       \
        }                                                                                                     \
    };
WG_POLICY(Bf16, "bf16")
WG_POLICY(F16, "f16")
#else
#define WGMMA_OK 0
#endif

// The backward of one tile of 128 keys on two warpgroups (warpgroup w owns
// keys 64w .. 64w + 63), which share each query tile; the arguments, outputs
// and the split of the group's query heads are those of bwd_mma. dQ = dS K
// over the block's keys: warpgroup w makes columns 32w .. 32w + 31 of it, so
// that the block adds each query tile's dQ once.
template <typename T>
__device__ void bwd_wgmma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const T* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, const u8* __restrict__ keep, const u32* __restrict__ start,
                          T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc,
                          float* __restrict__ dkv_acc, Params p) {
#if WGMMA_OK
    typedef Frag<T> M;
    typedef u16 E;
    constexpr int NW = 2;                      // warpgroups
    constexpr int BK = WG * NW;                // keys per block
    constexpr int TILE_E = WG * WG;            // elements of a 64 x 64 tile
    constexpr int NC = 8 / NW;                 // dQ column blocks of 8 per warpgroup
    extern __shared__ __align__(1024) unsigned char tc_smem[];
    // Swizzled tiles start on 1024-byte boundaries (the host adds 1024 bytes).
    E* Ks = reinterpret_cast<E*>(tc_smem + ((1024 - (smem_addr(tc_smem) & 1023)) & 1023));  // [BK][64]
    E* Vs = Ks + NW * TILE_E;                  // [BK][64]
    E* Qb = Vs + NW * TILE_E;                  // two Q tiles
    E* Db = Qb + 2 * TILE_E;                   // two dO tiles
    E* Ss = Db + 2 * TILE_E;                   // dS^T: [BK keys][64 queries]
    float* Lb = reinterpret_cast<float*>(Ss + NW * TILE_E);  // two lse * log2(e) rows
    float* Eb = Lb + 2 * WG;                                 // two delta rows
    const int bkv = block_head() / p.kv_splits, part = block_head() % p.kv_splits;
    const int j0 = blockIdx.x * BK;
    const int bb = bkv / p.kv_heads, kvh = bkv % p.kv_heads;
    const int group = p.heads / p.kv_heads, share = group / p.kv_splits;
    const int wg = warpgroup(), warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int jw = j0 + wg * WG;               // this warpgroup's first key
    const RowMask mask_row = row_mask(p, keep, start, bb);
    load_swz<BK>(Ks, reinterpret_cast<const E*>(k) + (i64)bkv * p.s_k * p.d, j0, p.s_k, p.d);
    load_swz<BK>(Vs, reinterpret_cast<const E*>(v) + (i64)bkv * p.s_k * p.d, j0, p.s_k, p.d);
    const int key_a = jw + warp * 16 + g;
    const int qstart = (first_query(p, j0) / WG) * WG;
    const int full_from = first_query(p, jw + WG - 1);
    const int nq = qstart < p.s_q ? (p.s_q - qstart + WG - 1) / WG : 0;
    const int total = share * nq;
    auto head_of = [&](int it) {
        return (i64)bb * p.heads + kvh * group + part * share + query_tile<WG>(it, nq, share, qstart).x;
    };
    auto fetch = [&](int it, int buf) {
        const i64 bh = head_of(it);
        const int i0 = query_tile<WG>(it, nq, share, qstart).y;
        load_swz<WG>(Qb + buf * TILE_E, reinterpret_cast<const E*>(q) + bh * p.s_q * p.d, i0, p.s_q, p.d);
        load_swz<WG>(Db + buf * TILE_E, reinterpret_cast<const E*>(dout) + bh * p.s_q * p.d, i0, p.s_q, p.d);
        load_rows<WG>(Lb + buf * WG, Eb + buf * WG, lse, delta, bh, i0, p.s_q);
    };
    if (total > 0) fetch(0, 0);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // This warp's 16 keys of K and V as A fragments (64 x 16 per k-step).
    u32 ka[4][4], va[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const int r = wg * WG + warp * 16 + g, c = kk * 16 + 2 * t;
        ka[kk][0] = lds32(Ks + swz(r, c));
        ka[kk][1] = lds32(Ks + swz(r + 8, c));
        ka[kk][2] = lds32(Ks + swz(r, c + 8));
        ka[kk][3] = lds32(Ks + swz(r + 8, c + 8));
        va[kk][0] = lds32(Vs + swz(r, c));
        va[kk][1] = lds32(Vs + swz(r + 8, c));
        va[kk][2] = lds32(Vs + swz(r, c + 8));
        va[kk][3] = lds32(Vs + swz(r + 8, c + 8));
    }
    float gk[8][4], gv[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) gk[n][e] = gv[n][e] = 0.f;
    // S^T = K Q^T, dP^T = V dO^T of query tile `it` (in buffer it & 1): B is
    // Q (dO) as K-major [query][d]. Issued, not waited for.
    float s[8][4], dp[8][4], gq[NC][4];
    const unsigned long long q_desc = wg_desc(Qb), do_desc = wg_desc(Db), k_desc = wg_desc(Ks), ds_desc = wg_desc(Ss);
    auto scores = [&](int it) {
        const unsigned long long qd = wg_at(q_desc, (it & 1) * TILE_E), dd = wg_at(do_desc, (it & 1) * TILE_E);
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wg<T>::template rs<0>(s, ka[kk], wg_at(qd, kk * 16), kk);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wg<T>::template rs<0>(dp, va[kk], wg_at(dd, kk * 16), kk);
        wg_commit();
    };
    auto add_dq = [&](int it) {
        wg_pin(gq);
        const int row0 = query_tile<WG>(it, nq, share, qstart).y + warp * 16;
        red_add_frags<NC>(dq_acc + head_of(it) * p.s_q * p.d, row0, p.s_q, wg * NC * 8, p.d, gq, p.scale, lane);
    };
    if (total > 0) {
        scores(0);
        if (total > 1) fetch(1, 1);  // buffer 1 is not read before scores(1)
        cp_async_commit();
        wg_wait<0>();
    }
    for (int it = 0; it < total; ++it) {
        const int i0 = query_tile<WG>(it, nq, share, qstart).y;
        const unsigned long long qd = wg_at(q_desc, (it & 1) * TILE_E), dd = wg_at(do_desc, (it & 1) * TILE_E);
        wg_pin(s);
        wg_pin(dp);
        const bool masked = p.has_keep || p.has_start || i0 < full_from || i0 + WG > p.s_q || jw + WG > p.s_k;
        probs_and_ds<8>(s, dp, Lb + (it & 1) * WG, Eb + (it & 1) * WG, p, mask_row, masked, i0, key_a, t);
        u32 pa[4][4], sa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            typename M::A x;
            M::pack_a(x, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = x.r[r];
            M::pack_a(x, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
            for (int r = 0; r < 4; ++r) sa[kk][r] = x.r[r];
            // dS^T: this warp's 16 keys (rows of the block's 128), queries 16 kk ...
            stmatrix_swz(Ss, wg * WG + warp * 16, kk * 16, x.r, lane);
        }
        // dV += P^T dO, dK += dS^T Q: B is dO (Q) as N-major [query][d].
        wg_pin(gk);
        wg_pin(gv);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wg<T>::template rs<1>(gv, pa[kk], wg_at(dd, kk * 16 * WG), 1);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wg<T>::template rs<1>(gk, sa[kk], wg_at(qd, kk * 16 * WG), 1);
        fence_async_smem();
        __syncthreads();
        // dQ = dS K over the block's keys: A is dS^T as M-major [key][query],
        // B is K as N-major [key][d], this warpgroup's columns.
#pragma unroll
        for (int kk = 0; kk < 4 * NW; ++kk)
            Wg<T>::template ss<1, 1>(gq, wg_at(ds_desc, kk * 16 * WG), wg_at(k_desc, kk * 16 * WG + wg * NC * 8),
                                     kk);
        wg_commit();
        if (it + 1 < total) {
            // The next tile's scores run while this tile's dQ is added.
            scores(it + 1);
            wg_wait<1>();
            add_dq(it);
            // Every warpgroup is done with buffer it & 1 and with Ss.
            __syncthreads();
            if (it + 2 < total) fetch(it + 2, it & 1);
            cp_async_commit();
            wg_wait<0>();
        } else {
            wg_wait<0>();
            add_dq(it);
        }
    }
    wg_pin(gk);
    wg_pin(gv);
    store_dkdv<T, 8>(gk, gv, dk, dv, dkv_acc, p, bkv, jw + warp * 16, lane);
#else
    __trap();
#endif
}

// The forward of one tile of 128 queries on two warpgroups (warpgroup w owns
// queries 64w .. 64w + 63), as fwd_mma, on wgmma: S = Q K^T from shared
// memory, O += P V with P from registers; tiles of 64 keys
// (K double-, V triple-buffered, so that the next tiles load while this
// one's P V runs) in swizzled shared memory.
template <typename T>
__device__ void fwd_wgmma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          T* __restrict__ o, float* __restrict__ lse, const u8* __restrict__ keep,
                          const u32* __restrict__ start, Params p) {
#if WGMMA_OK
    typedef Frag<T> M;
    typedef u16 E;
    constexpr int NW = 2, BM = WG * NW, TILE_E = WG * WG;
    extern __shared__ __align__(1024) unsigned char tc_smem[];
    E* Qs = reinterpret_cast<E*>(tc_smem + ((1024 - (smem_addr(tc_smem) & 1023)) & 1023));  // [BM][64]
    E* Kb = Qs + NW * TILE_E;  // two K tiles
    E* Vb = Kb + 2 * TILE_E;   // three V tiles
    const int bh = block_head();
    const int tiles = (p.s_q + BM - 1) / BM;
    const int i0 = (tiles - 1 - (int)blockIdx.x) * BM;
    const int bb = bh / p.heads, h = bh % p.heads;
    const int kvh = h / (p.heads / p.kv_heads);
    const int wg = warpgroup(), warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const E* kh = reinterpret_cast<const E*>(k) + ((i64)bb * p.kv_heads + kvh) * p.s_k * p.d;
    const E* vh = reinterpret_cast<const E*>(v) + ((i64)bb * p.kv_heads + kvh) * p.s_k * p.d;
    const RowMask mask_row = row_mask(p, keep, start, bb);
    const float sl2 = p.scale * LOG2E;

    const int last = min(i0 + BM, p.s_q) - 1;
    const int kend = key_end(p, last);
    load_swz<BM>(Qs, reinterpret_cast<const E*>(q) + (i64)bh * p.s_q * p.d, i0, p.s_q, p.d);
    if (kend > 0) {
        load_swz<WG>(Kb, kh, 0, p.s_k, p.d);
        load_swz<WG>(Vb, vh, 0, p.s_k, p.d);
    }
    cp_async_commit();
    const unsigned long long q_desc = wg_desc(Qs + wg * TILE_E);  // this warpgroup's queries
    const unsigned long long k_desc = wg_desc(Kb), v_desc = wg_desc(Vb);
    float acc[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    // This thread's rows: row_a and row_a + 8.
    const int row_a = i0 + wg * WG + warp * 16 + g;
    // Key tiles from `full_end` on may hide keys from some rows of the block.
    const int full_end = p.has_keep || p.has_start ? 0 : key_end(p, i0);
    for (int j0 = 0, it = 0; j0 < kend; j0 += WG, ++it) {
        const unsigned long long kd = wg_at(k_desc, (it & 1) * TILE_E), vd = wg_at(v_desc, (it % 3) * TILE_E);
        // Tile `it` has arrived; every warpgroup is done with tile it - 1's K
        // and tile it - 2's V, whose buffers the next tile takes.
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();
        if (j0 + WG < kend) {
            load_swz<WG>(Kb + ((it + 1) & 1) * TILE_E, kh, j0 + WG, p.s_k, p.d);
            load_swz<WG>(Vb + ((it + 1) % 3) * TILE_E, vh, j0 + WG, p.s_k, p.d);
        }
        cp_async_commit();
        // S = Q K^T: A is Q as K-major [query][d], B is K as K-major [key][d].
        float s[8][4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            Wg<T>::template ss64<0, 0>(s, wg_at(q_desc, kk * 16), wg_at(kd, kk * 16), kk);
        wg_commit();
        wg_wait<0>();  // also the last tile's P V
        wg_pin(s);
        wg_pin(acc);
        if (j0 + WG > full_end) mask_tile(s, p, mask_row, row_a, j0, t);
        softmax_tile<8>(s, acc, m, l, sl2);
        u32 pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            typename M::A x;
            M::pack_a(x, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = x.r[r];
        }
        // O += P V: B is V as N-major [key][d].
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wg<T>::template rs<1>(acc, pa[kk], wg_at(vd, kk * 16 * WG), 1);
        wg_commit();
        wg_wait<0>();
        wg_pin(acc);
    }
    cp_async_wait<0>();  // Q's copy when no key is seen
    store_rows<T, 8>(acc, m, l, o, lse, p, bh, row_a, t);
#else
    __trap();
#endif
}

// Four values into dst in T, as one store (dst aligned to four elements).
__device__ __forceinline__ void store4(float* dst, float4 x) { *reinterpret_cast<float4*>(dst) = x; }
template <typename T> __device__ __forceinline__ u32 bits2(float lo, float hi) {
    return (u32)from_f32<T>(lo).bits | ((u32)from_f32<T>(hi).bits << 16);
}
template <typename T> __device__ __forceinline__ void store4(T* dst, float4 x) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(bits2<T>(x.x, x.y), bits2<T>(x.z, x.w));
}

// dq = dq_acc in the output type (n elements): four at a time where both
// are aligned to four elements (a split dK/dV accumulator's second half may
// not be), then the rest one at a time.
template <typename T>
__device__ void dq_convert(const float* __restrict__ acc, T* __restrict__ dq, i64 n) {
    const i64 step = (i64)gridDim.x * blockDim.x, first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec =
        (reinterpret_cast<size_t>(acc) & 15) == 0 && (reinterpret_cast<size_t>(dq) & (4 * sizeof(T) - 1)) == 0;
    const i64 quads = vec ? n / 4 : 0;
    for (i64 i = first; i < quads; i += step) store4(dq + 4 * i, reinterpret_cast<const float4*>(acc)[i]);
    for (i64 i = quads * 4 + first; i < n; i += step) dq[i] = from_f32<T>(acc[i]);
}

// ===========================================================================
// Entry points: <kernel>_<dtype>_<D>.

#define SIMT_ENTRIES(TN, T, D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) flash_fwd_simt_##TN##_##D(                                 \
        const T* q, const T* k, const T* v, T* o, float* lse, const u8* keep, const u32* start, Params p) {      \
        fwd_simt<T, D>(q, k, v, o, lse, keep, start, p);                                                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) flash_dkdv_simt_##TN##_##D(                                \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, const u8* keep, \
        const u32* start, T* dk, T* dv, Params p) {                                                              \
        dkdv_simt<T, D>(q, k, v, dout, lse, delta, keep, start, dk, dv, p);                                      \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) flash_dq_simt_##TN##_##D(                                  \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, const u8* keep, \
        const u32* start, T* dq, Params p) {                                                                     \
        dq_simt<T, D>(q, k, v, dout, lse, delta, keep, start, dq, p);                                            \
    }

#define MMA_ENTRIES(TN, T, D, RG, BQ)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) flash_fwd_mma_##TN##_##D(                                  \
        const T* q, const T* k, const T* v, T* o, float* lse, const u8* keep,                                    \
        const u32* start, Params p, int vec) {                                                                   \
        fwd_mma<T, D, RG>(q, k, v, o, lse, keep, start, p, vec);                                                 \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) flash_bwd_mma_##TN##_##D(                                  \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, const u8* keep, \
        const u32* start, T* dk, T* dv, float* dq_acc, float* dkv_acc, Params p, int vec) {                      \
        bwd_mma<T, D, BQ>(q, k, v, dout, lse, delta, keep, start, dk, dv, dq_acc, dkv_acc, p, vec);              \
    }

#define WGMMA_ENTRY(TN, T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) flash_fwd_wgmma_##TN##_64(                          \
        const T* q, const T* k, const T* v, T* o, float* lse, const u8* keep,                                    \
        const u32* start, Params p, int vec) {                                                                   \
        fwd_wgmma<T>(q, k, v, o, lse, keep, start, p);                                                           \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) flash_bwd_wgmma_##TN##_64(                          \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, const u8* keep, \
        const u32* start, T* dk, T* dv, float* dq_acc, float* dkv_acc, Params p, int vec) {                      \
        bwd_wgmma<T>(q, k, v, dout, lse, delta, keep, start, dk, dv, dq_acc, dkv_acc, p);                        \
    }

#define DELTA_ENTRY(TN, T)                                                                                    \
    extern "C" __global__ void flash_delta_##TN(const T* o, const T* dout, float* delta, i64 rows, int d, int lg, \
                                                int vec) {                                                    \
        delta_kernel<T>(o, dout, delta, rows, d, lg, vec);                                                    \
    }                                                                                                         \
    extern "C" __global__ void flash_dq_convert_##TN(const float* acc, T* dq, i64 n) {                         \
        dq_convert<T>(acc, dq, n);                                                                            \
    }

SIMT_ENTRIES(f32, float, 64)
SIMT_ENTRIES(f32, float, 128)
SIMT_ENTRIES(bf16, Bf16, 64)
SIMT_ENTRIES(bf16, Bf16, 128)
SIMT_ENTRIES(f16, F16, 64)
SIMT_ENTRIES(f16, F16, 128)
MMA_ENTRIES(f32, float, 64, 1, 32)
MMA_ENTRIES(f32, float, 128, 1, 32)
MMA_ENTRIES(bf16, Bf16, 64, 2, 32)
MMA_ENTRIES(bf16, Bf16, 128, 1, 32)
MMA_ENTRIES(f16, F16, 64, 2, 32)
MMA_ENTRIES(f16, F16, 128, 1, 32)
WGMMA_ENTRY(bf16, Bf16)
WGMMA_ENTRY(f16, F16)
DELTA_ENTRY(f32, float)
DELTA_ENTRY(bf16, Bf16)
DELTA_ENTRY(f16, F16)
