//! Memory-efficient scaled dot-product attention with a backward pass
//! (the FlashAttention-2 scheme, on the CPU and, with the `cuda` feature, on
//! CUDA devices).
//!
//! The planner half ([`FlashAttention`]) switches a plan's [`Attention`] from the
//! composed expression to this op; the mechanism is [`flash_attention`].
//!
//! [`flash_attention`] computes `softmax(q·kᵀ·scale + mask)·v` without ever
//! holding the `s_q × s_k` score or probability matrices. The forward pass walks
//! blocks of queries and keys with an online softmax and keeps, besides the
//! output, one log-sum-exp per query row. The backward pass recomputes the
//! probabilities block by block from that log-sum-exp. What the autograd graph
//! keeps for backward is therefore the inputs, the output and
//! `4 · batch · heads · s_q` bytes (plus one byte per key when a padding mask is
//! given, and four per query position with key starts), instead of the
//! `batch · heads · s_q · s_k` probabilities that composed attention keeps.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use oomfix_strategies::attention::{flash_attention, AttentionOptions};
//!
//! let dev = Device::Cpu;
//! let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 4, 10, 8), &dev)?)?;
//! let k = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 10, 8), &dev)?)?;
//! let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 10, 8), &dev)?)?;
//! let opts = AttentionOptions { causal: true, ..Default::default() };
//! let o = flash_attention(&q, &k, &v, &opts)?;
//! assert_eq!(o.dims(), [1, 4, 10, 8]);
//! let grads = o.sum_all()?.backward()?;
//! assert_eq!(grads.get(&k).unwrap().dims(), [1, 2, 10, 8]);
//! # Ok::<(), candle_core::Error>(())
//! ```

use std::borrow::Cow;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::custom_op::{CustomOp, Input, Kernel};
use crate::float::{contiguous_range, is_kernel_dtype, Float};
use crate::{Attention, Execution, Plan, SearchContext, Strategy};

#[cfg(feature = "cuda")]
mod cuda;

/// Planner half: compute attention with [`flash_attention`] instead of composing it
/// from candle ops.
///
/// It removes every `batch × heads × seq × seq` tensor a block keeps for backward
/// and costs no compute (the op is faster than the composed expression on the CPU
/// and on CUDA), so it is never relaxed. The op runs on the CPU and, with the
/// `cuda` feature, on CUDA devices (head dimension up to 128 there).
///
/// ```
/// use oomfix_strategies::attention::FlashAttention;
/// use oomfix_strategies::{Attention, Plan, SearchContext, Strategy};
///
/// let ctx = SearchContext::new(8, 12);
/// let flash = FlashAttention.tighten(&Plan::baseline(8, 1024), &ctx).unwrap();
/// assert_eq!(flash.attention, Attention::Flash);
/// assert!(FlashAttention.tighten(&flash, &ctx).is_none());
/// assert!(FlashAttention.relax(&flash, &ctx).is_none());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct FlashAttention;

impl Strategy for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        (ctx.flash_attention && plan.attention == Attention::Composed).then_some(Plan {
            attention: Attention::Flash,
            ..*plan
        })
    }
    /// Attention as the plan says ([`flash_attention`] for [`Attention::Flash`]).
    /// Its memory terms are activations, which the memory model derives from
    /// the plan's `attention` field.
    fn execution(&self, plan: &Plan, exec: &mut Execution) {
        exec.attention = plan.attention;
    }
    /// Needs a model that computes attention as the execution says, and a
    /// kernel for its heads on the device.
    fn unusable(&self, ctx: &SearchContext) -> Option<String> {
        if !ctx.model.attention {
            return Some(
                "needs a model that computes its attention as the plan's execution says \
                 (flash attention computes neither soft-capped scores nor sliding windows)"
                    .into(),
            );
        }
        (!ctx.flash_attention).then(|| {
            format!(
                "needs a flash-attention kernel for the model's heads on the device (the CPU \
                 has one for every head size, CUDA for head sizes up to {CUDA_MAX_HEAD_DIM})"
            )
        })
    }
}

// ---------------------------------------------------------------------------
// Mechanism: the attention op.

/// Query rows per block.
const BLOCK_Q: usize = 64;
/// Key rows per block.
const BLOCK_K: usize = 64;

/// Largest head dimension [`flash_attention`] supports on CUDA devices.
pub const CUDA_MAX_HEAD_DIM: usize = 128;

/// Options of [`flash_attention`].
#[derive(Debug, Clone, Default)]
pub struct AttentionOptions {
    /// Causal masking: query `i` sees key `j` only when `j <= i + s_k - s_q`
    /// (the mask is aligned to the bottom-right corner, so that with `s_q < s_k`
    /// the queries are the last `s_q` positions; with `s_q == s_k` it is the usual
    /// lower triangle).
    pub causal: bool,
    /// Factor applied to `q·kᵀ`, positive and finite (the kernels take row
    /// maxima before scaling); `None` means `1 / sqrt(d)`.
    pub scale: Option<f32>,
    /// Key padding mask of shape `[b, s_k]`, any dtype: non-zero keeps a key,
    /// zero masks it out for every query and head of that batch row.
    pub key_padding: Option<Tensor>,
    /// Each query's first visible key, `[b, s_q]` of an integer dtype: query
    /// `i` of batch row `bb` sees no key before `key_start[bb, i]` (packed
    /// documents: with `causal`, the first position of the query's
    /// document). The CPU kernels skip the key blocks before a query
    /// block's smallest start; the CUDA kernels mask them.
    pub key_start: Option<Tensor>,
}

/// Scaled dot-product attention that never materialises the `s_q × s_k` matrices.
///
/// `q` is `[b, heads, s_q, d]`; `k` and `v` are `[b, kv_heads, s_k, d]` with
/// `heads` a multiple of `kv_heads` (grouped-query attention: query head `h`
/// uses key/value head `h / (heads / kv_heads)`). All three share one dtype
/// (f32, bf16 or f16; the arithmetic is f32) and the output `[b, heads, s_q, d]`
/// has that dtype. A query row whose keys are all masked gives zeros.
///
/// Gradients flow to `q`, `k` and `v` through candle's autograd. Runs on the
/// CPU (threads over batch × head) and, with the `cuda` feature, on CUDA
/// devices (kernels compiled at run time; head dimension up to 128); other
/// devices return an error.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOptions,
) -> candle_core::Result<Tensor> {
    let dims = Dims::of(q, k, v)?;
    let scale = opts.scale.unwrap_or(1.0 / (dims.d as f32).sqrt());
    if !(scale.is_finite() && scale > 0.0) {
        bail!("flash_attention: scale must be positive and finite, got {scale}");
    }
    let (keep, keep_device) = match &opts.key_padding {
        Some(mask) if q.device().is_cuda() => {
            (None, Some(keep_tensor(mask, dims.b, dims.s_k, q.device())?))
        }
        Some(mask) => (Some(keep_mask(mask, dims.b, dims.s_k)?), None),
        None => (None, None),
    };
    let (start, start_device) = match &opts.key_start {
        Some(start) => {
            let start = start_tensor(start, dims.b, dims.s_q, q.device())?;
            if q.device().is_cuda() {
                (None, Some(start))
            } else {
                (Some(start.flatten_all()?.to_vec1::<u32>()?), None)
            }
        }
        None => (None, None),
    };
    let op = FlashOp {
        dims,
        params: Params {
            causal: opts.causal,
            scale,
        },
        keep,
        keep_device,
        start,
        start_device,
        lse: OnceLock::new(),
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, CustomOp(op))
}

/// Problem sizes, checked against each other.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    heads: usize,
    kv_heads: usize,
    s_q: usize,
    s_k: usize,
    d: usize,
}

impl Dims {
    /// The sizes of `q`, `k`, `v`, or an error when their shapes or dtypes do not fit.
    fn of(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Self> {
        let (b, heads, s_q, d) = q.dims4()?;
        let (bk, kv_heads, s_k, dk) = k.dims4()?;
        if (bk, dk) != (b, d) || v.dims() != k.dims() {
            bail!(
                "flash_attention: q {:?}, k {:?} and v {:?} do not fit \
                 [b, heads, s_q, d], [b, kv_heads, s_k, d], [b, kv_heads, s_k, d]",
                q.dims(),
                k.dims(),
                v.dims()
            );
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            bail!("flash_attention: {heads} query heads are not a multiple of {kv_heads} kv heads");
        }
        if d == 0 {
            bail!("flash_attention: head dimension is zero");
        }
        let dtype = q.dtype();
        if k.dtype() != dtype || v.dtype() != dtype || !is_kernel_dtype(dtype) {
            bail!(
                "flash_attention: q, k, v must share one dtype of f32, bf16, f16; got {:?}, {:?}, {:?}",
                q.dtype(),
                k.dtype(),
                v.dtype()
            );
        }
        Ok(Dims {
            b,
            heads,
            kv_heads,
            s_q,
            s_k,
            d,
        })
    }

    /// Elements of one query head (`s_q × d`) and of one key head (`s_k × d`).
    fn head_sizes(&self) -> (usize, usize) {
        (self.s_q * self.d, self.s_k * self.d)
    }

    /// Offset of the key/value head used by the flat (batch, query head) index `bh`.
    fn kv_offset(&self, bh: usize) -> usize {
        let group = self.heads / self.kv_heads;
        let (b, h) = (bh / self.heads, bh % self.heads);
        (b * self.kv_heads + h / group) * self.s_k * self.d
    }
}

/// Reads a `[b, s_k]` key padding mask as one byte per key (1 = keep).
fn keep_mask(mask: &Tensor, b: usize, s_k: usize) -> candle_core::Result<Vec<u8>> {
    keep_tensor(mask, b, s_k, &candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<u8>()
}

/// A `[b, s_k]` key padding mask as a contiguous u8 tensor on `device` (1 = keep).
fn keep_tensor(
    mask: &Tensor,
    b: usize,
    s_k: usize,
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    if mask.dims() != [b, s_k] {
        bail!(
            "flash_attention: key_padding has shape {:?}, expected [{b}, {s_k}]",
            mask.dims()
        );
    }
    mask.to_device(device)?.ne(0.0)?.contiguous()
}

/// A `[b, s_q]` tensor of key starts (an integer dtype) as a contiguous u32
/// tensor on `device`.
fn start_tensor(
    start: &Tensor,
    b: usize,
    s_q: usize,
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    if start.dims() != [b, s_q] || !start.dtype().is_int() {
        bail!(
            "flash_attention: key_start is {:?} {:?}, expected [{b}, {s_q}] of an integer dtype",
            start.dims(),
            start.dtype()
        );
    }
    start.to_device(device)?.to_dtype(DType::U32)?.contiguous()
}

/// Log-sum-exp of every query row, where the forward pass ran.
enum Lse {
    /// On the host (CPU op).
    Host(Vec<f32>),
    /// On the CUDA device (CUDA op).
    #[cfg(feature = "cuda")]
    Device(candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>),
}

/// The scalar settings the kernels need.
#[derive(Debug, Clone, Copy)]
struct Params {
    causal: bool,
    scale: f32,
}

/// The custom op: forward on the CPU, backward by block recomputation.
struct FlashOp {
    dims: Dims,
    params: Params,
    /// `[b, s_k]` keep flags for the CPU op, or `None` when no key is padded.
    keep: Option<Vec<u8>>,
    /// `[b, s_k]` keep flags (u8) on the inputs' CUDA device, or `None`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    keep_device: Option<Tensor>,
    /// `[b, s_q]` first visible key of each query for the CPU op, or `None`
    /// (key 0).
    start: Option<Vec<u32>>,
    /// `[b, s_q]` key starts (u32) on the inputs' CUDA device, or `None`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    start_device: Option<Tensor>,
    /// Log-sum-exp of every query row's scores, `[b, heads, s_q]`, written by
    /// the forward pass; `-inf` for a row with no visible key.
    lse: OnceLock<Lse>,
}

impl FlashOp {
    /// The keep flags of batch row `b`.
    fn keep_row(&self, b: usize) -> Option<&[u8]> {
        let s_k = self.dims.s_k;
        self.keep.as_deref().map(|k| &k[b * s_k..(b + 1) * s_k])
    }

    /// The key starts of batch row `b`.
    fn start_row(&self, b: usize) -> Option<&[u32]> {
        let s_q = self.dims.s_q;
        self.start.as_deref().map(|st| &st[b * s_q..(b + 1) * s_q])
    }

    /// The part of (batch, query head) pair `bh` of the CPU op's inputs.
    fn head<'a>(&'a self, bh: usize, q: &'a [f32], k: &'a [f32], v: &'a [f32]) -> Head<'a> {
        let dims = &self.dims;
        let (q_len, k_len) = dims.head_sizes();
        let kv = dims.kv_offset(bh);
        Head {
            q: &q[bh * q_len..][..q_len],
            k: &k[kv..][..k_len],
            v: &v[kv..][..k_len],
            keep: self.keep_row(bh / dims.heads),
            start: self.start_row(bh / dims.heads),
            dims,
            params: self.params,
        }
    }
}

impl Kernel<3> for FlashOp {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        [(s1, l1), (s2, l2), (s3, l3)]: [Input<'_, CpuStorage>; 3],
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, k, v) = (f32_view(s1, l1)?, f32_view(s2, l2)?, f32_view(s3, l3)?);
        let dims = self.dims;
        let (q_len, _) = dims.head_sizes();
        let mut out = vec![0f32; dims.b * dims.heads * q_len];
        let mut lse = vec![f32::NEG_INFINITY; dims.b * dims.heads * dims.s_q];
        if q_len > 0 {
            out.par_chunks_mut(q_len)
                .zip(lse.par_chunks_mut(dims.s_q))
                .enumerate()
                .for_each(|(bh, (out, lse))| self.head(bh, &q, &k, &v).forward(out, lse));
        }
        if self.lse.set(Lse::Host(lse)).is_err() {
            bail!("flash_attention: forward ran twice on one op");
        }
        let shape = Shape::from((dims.b, dims.heads, dims.s_q, dims.d));
        Ok((storage_from_f32(out, s1.dtype())?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        inputs: [Input<'_, candle_core::CudaStorage>; 3],
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let masks = (self.keep_device.as_ref(), self.start_device.as_ref());
        let (out, shape, lse) = cuda::forward(&self.dims, &self.params, masks, inputs)?;
        if self.lse.set(Lse::Device(lse)).is_err() {
            bail!("flash_attention: forward ran twice on one op");
        }
        Ok((out, shape))
    }

    fn bwd(
        &self,
        [q, k, v]: [&Tensor; 3],
        o: &Tensor,
        grad_o: &Tensor,
    ) -> candle_core::Result<[Option<Tensor>; 3]> {
        let lse = match self.lse.get() {
            None => bail!("flash_attention: backward before forward"),
            Some(Lse::Host(lse)) => lse,
            #[cfg(feature = "cuda")]
            Some(Lse::Device(lse)) => {
                let masks = (self.keep_device.as_ref(), self.start_device.as_ref());
                let (dq, dk, dv) =
                    cuda::backward(&self.dims, &self.params, masks, lse, q, k, v, o, grad_o)?;
                return Ok([Some(dq), Some(dk), Some(dv)]);
            }
        };
        let dims = self.dims;
        let (q_len, k_len) = dims.head_sizes();
        let [q32, k32, v32, o32, do32] = [q, k, v, o, grad_o].map(f32_vec);
        let (q32, k32, v32, o32, do32) = (q32?, k32?, v32?, o32?, do32?);
        let heads = dims.b * dims.heads;
        let mut dq = vec![0f32; heads * q_len];
        // Per query head; summed over each kv head's group below.
        let mut dk = vec![0f32; heads * k_len];
        let mut dv = vec![0f32; heads * k_len];
        if q_len > 0 && k_len > 0 {
            dq.par_chunks_mut(q_len)
                .zip(dk.par_chunks_mut(k_len))
                .zip(dv.par_chunks_mut(k_len))
                .enumerate()
                .for_each(|(bh, ((dq, dk), dv))| {
                    let head = self.head(bh, &q32, &k32, &v32);
                    let rows = bh * dims.s_q..(bh + 1) * dims.s_q;
                    let up = Upstream {
                        o: &o32[bh * q_len..][..q_len],
                        grad: &do32[bh * q_len..][..q_len],
                        lse: &lse[rows],
                    };
                    head.backward(
                        &up,
                        Grads {
                            q: dq,
                            k: dk,
                            v: dv,
                        },
                    );
                });
        }
        let group = dims.heads / dims.kv_heads;
        let grad = |data: Vec<f32>, like: &Tensor| {
            Tensor::from_vec(data, like.shape(), like.device())?.to_dtype(like.dtype())
        };
        Ok([
            Some(grad(dq, q)?),
            Some(grad(sum_groups(dk, group, k_len), k)?),
            Some(grad(sum_groups(dv, group, k_len), v)?),
        ])
    }
}

/// The elements of a contiguous f32, bf16 or f16 CPU storage as f32 (borrowed for f32).
fn f32_view<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<Cow<'a, [f32]>> {
    let r = contiguous_range(l)?;
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[r]),
        CpuStorage::BF16(v) => Cow::Owned(v[r].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F16(v) => Cow::Owned(v[r].iter().map(|x| x.to_f32()).collect()),
        other => bail!("flash_attention: unsupported dtype {:?}", other.dtype()),
    })
}

/// A CPU storage of `dtype` (f32, bf16 or f16) holding `v`.
fn storage_from_f32(v: Vec<f32>, dtype: DType) -> candle_core::Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(Float::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(Float::from_f32).collect()),
        other => bail!("flash_attention: unsupported dtype {other:?}"),
    })
}

/// The elements of `t` as a flat f32 vector.
fn f32_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// Sums each run of `group` consecutive chunks of `len` elements.
fn sum_groups(per_head: Vec<f32>, group: usize, len: usize) -> Vec<f32> {
    if group == 1 || len == 0 {
        return per_head;
    }
    per_head
        .chunks(group * len)
        .flat_map(|heads| {
            let mut sum = heads[..len].to_vec();
            for h in heads[len..].chunks(len) {
                add_assign(&mut sum, h);
            }
            sum
        })
        .collect()
}

/// One (batch, query head) pair: its queries and the keys and values it reads.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    keep: Option<&'a [u8]>,
    /// The first key each query sees (`s_q` of them), or `None` (key 0).
    start: Option<&'a [u32]>,
    dims: &'a Dims,
    params: Params,
}

/// What backward gets from above for one head: the output, its gradient, the log-sum-exp.
struct Upstream<'a> {
    o: &'a [f32],
    grad: &'a [f32],
    lse: &'a [f32],
}

/// Gradient accumulators of one head (`k` and `v` for this query head only).
struct Grads<'a> {
    q: &'a mut [f32],
    k: &'a mut [f32],
    v: &'a mut [f32],
}

impl Head<'_> {
    /// End (exclusive) of the keys query row `i` may see.
    fn key_end(&self, i: usize) -> usize {
        let s_k = self.dims.s_k;
        if self.params.causal {
            (i + 1 + s_k).saturating_sub(self.dims.s_q).min(s_k)
        } else {
            s_k
        }
    }

    /// Start of the keys query row `i` may see.
    fn key_begin(&self, i: usize) -> usize {
        self.start.map_or(0, |st| st[i] as usize)
    }

    /// The keys any of the query rows `i0..i0 + rows` may see: from the
    /// smallest start to the last row's end (empty when none does).
    fn block_keys(&self, i0: usize, rows: usize) -> std::ops::Range<usize> {
        let begin = (i0..i0 + rows)
            .map(|i| self.key_begin(i))
            .min()
            .unwrap_or(0);
        let end = self.key_end(i0 + rows - 1);
        begin.min(end)..end
    }

    /// `s[r, c] = scale · q[i0 + r] · k[j0 + c]`, then `-inf` where key `j0 + c`
    /// is padded or hidden from query `i0 + r`. `s` is `rows × cols`, row-major.
    fn scores(&self, s: &mut [f32], i0: usize, rows: usize, j0: usize, cols: usize) {
        let d = self.dims.d;
        let q = View::rows(&self.q[i0 * d..], rows, d, d);
        let k = View::rows(&self.k[j0 * d..], cols, d, d);
        matmul(s, cols, q, k.t(), self.params.scale, false);
        for (r, row) in s[..rows * cols].chunks_exact_mut(cols).enumerate() {
            let visible = self.key_end(i0 + r).saturating_sub(j0).min(cols);
            row[visible..].fill(f32::NEG_INFINITY);
            let hidden = self.key_begin(i0 + r).saturating_sub(j0).min(visible);
            row[..hidden].fill(f32::NEG_INFINITY);
            if let Some(keep) = self.keep {
                for (x, &kept) in row[..visible].iter_mut().zip(&keep[j0..]) {
                    if kept == 0 {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// Writes the head's output (`s_q × d`) and the log-sum-exp of each query row.
    fn forward(&self, out: &mut [f32], lse: &mut [f32]) {
        let Dims { s_q, d, .. } = *self.dims;
        let mut s = vec![0f32; BLOCK_Q * BLOCK_K];
        let mut max = [0f32; BLOCK_Q];
        let mut sum = [0f32; BLOCK_Q];
        for i0 in (0..s_q).step_by(BLOCK_Q) {
            let rows = BLOCK_Q.min(s_q - i0);
            let acc = &mut out[i0 * d..(i0 + rows) * d];
            max.fill(f32::NEG_INFINITY);
            sum.fill(0.0);
            let keys = self.block_keys(i0, rows);
            let key_end = keys.end;
            for j0 in keys.step_by(BLOCK_K) {
                let cols = BLOCK_K.min(key_end - j0);
                self.scores(&mut s, i0, rows, j0, cols);
                for (r, row) in s[..rows * cols].chunks_exact_mut(cols).enumerate() {
                    let new_max = row.iter().fold(max[r], |m, &x| m.max(x));
                    if new_max == f32::NEG_INFINITY {
                        row.fill(0.0); // nothing visible yet: p = 0
                        continue;
                    }
                    let rescale = (max[r] - new_max).exp();
                    sum[r] = sum[r] * rescale + exp_shifted(row, new_max);
                    max[r] = new_max;
                    if rescale != 1.0 {
                        acc[r * d..(r + 1) * d]
                            .iter_mut()
                            .for_each(|x| *x *= rescale);
                    }
                }
                let p = View::rows(&s, rows, cols, cols);
                let v = View::rows(&self.v[j0 * d..], cols, d, d);
                matmul(acc, d, p, v, 1.0, true);
            }
            for (r, row) in acc.chunks_exact_mut(d).enumerate() {
                if sum[r] > 0.0 {
                    let inv = 1.0 / sum[r];
                    row.iter_mut().for_each(|x| *x *= inv);
                    lse[i0 + r] = max[r] + sum[r].ln();
                } else {
                    row.fill(0.0);
                    lse[i0 + r] = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Adds this head's gradients to `g`, recomputing the probabilities block by
    /// block from the saved log-sum-exp.
    fn backward(&self, up: &Upstream, g: Grads) {
        let Dims { s_q, d, .. } = *self.dims;
        let scale = self.params.scale;
        // D_i = dO_i · O_i, the softmax backward's row term.
        let delta: Vec<f32> = up
            .grad
            .chunks_exact(d)
            .zip(up.o.chunks_exact(d))
            .map(|(a, b)| dot(a, b))
            .collect();
        let mut p = vec![0f32; BLOCK_Q * BLOCK_K];
        let mut dp = vec![0f32; BLOCK_Q * BLOCK_K];
        for i0 in (0..s_q).step_by(BLOCK_Q) {
            let rows = BLOCK_Q.min(s_q - i0);
            let q = View::rows(&self.q[i0 * d..], rows, d, d);
            let grad_o = View::rows(&up.grad[i0 * d..], rows, d, d);
            let keys = self.block_keys(i0, rows);
            let key_end = keys.end;
            for j0 in keys.step_by(BLOCK_K) {
                let cols = BLOCK_K.min(key_end - j0);
                self.scores(&mut p, i0, rows, j0, cols);
                for (r, row) in p[..rows * cols].chunks_exact_mut(cols).enumerate() {
                    let lse = up.lse[i0 + r];
                    if lse == f32::NEG_INFINITY {
                        row.fill(0.0); // a row that sees no key: zero output, zero gradient
                    } else {
                        exp_shifted(row, lse);
                    }
                }
                let pv = View::rows(&p, rows, cols, cols);
                let k = View::rows(&self.k[j0 * d..], cols, d, d);
                let v = View::rows(&self.v[j0 * d..], cols, d, d);
                // dV_j += Pᵀ dO_i
                matmul(&mut g.v[j0 * d..], d, pv.t(), grad_o, 1.0, true);
                // dP = dO_i V_jᵀ, then dS = P ∘ (dP − D) in place
                matmul(&mut dp, cols, grad_o, v.t(), 1.0, false);
                for (r, (ds, p)) in dp[..rows * cols]
                    .chunks_exact_mut(cols)
                    .zip(p.chunks_exact(cols))
                    .enumerate()
                {
                    let dr = delta[i0 + r];
                    ds.iter_mut().zip(p).for_each(|(x, &p)| *x = p * (*x - dr));
                }
                let ds = View::rows(&dp, rows, cols, cols);
                // dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i
                matmul(&mut g.q[i0 * d..], d, ds, k, scale, true);
                matmul(&mut g.k[j0 * d..], d, ds.t(), q, scale, true);
            }
        }
    }
}

/// `x = exp(x - shift)` over a row; returns the row's new sum (`-inf` entries become 0).
fn exp_shifted(row: &mut [f32], shift: f32) -> f32 {
    let mut total = 0.0;
    for x in row {
        *x = (*x - shift).exp();
        total += *x;
    }
    total
}

/// Dot product with eight partial sums (lets the compiler vectorise it).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `a += b` elementwise.
fn add_assign(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

/// A strided matrix inside a slice: element `(r, c)` is `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    /// A row-major `rows × cols` matrix at the start of `data` with row stride `ld`.
    fn rows(data: &'a [f32], rows: usize, cols: usize, ld: usize) -> Self {
        View {
            data,
            rows,
            cols,
            rs: ld,
            cs: 1,
        }
    }

    /// The transpose (no copy).
    fn t(self) -> Self {
        View {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether every element lies inside `data`.
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.data.len()
    }
}

/// `dst = beta · a · b`, or `dst += beta · a · b` when `accumulate`; `dst` is
/// row-major with row stride `ld`.
fn matmul(dst: &mut [f32], ld: usize, a: View, b: View, beta: f32, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(
        m > 0
            && n > 0
            && b.rows == k
            && k > 0
            && n <= ld
            && a.in_bounds()
            && b.in_bounds()
            && (m - 1) * ld + n <= dst.len(),
        "flash_attention: block matmul out of bounds"
    );
    // SAFETY: the assertion keeps every element gemm touches inside the three
    // slices, and `dst` (exclusive) cannot alias `a` or `b` (shared).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ld as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}
