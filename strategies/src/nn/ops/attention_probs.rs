//! Attention probabilities `softmax(q·kᵀ·scale + mask)` as one graph node
//! that keeps only its output.
//!
//! Composed from candle ops, the scores, the masked scores, the softmax's
//! shifted values, exponentials and output (five `[b,H,s,s]` tensors per
//! block) stay alive until backward, and the broadcast mask and row maximum
//! leave score-sized stray gradients. Here the scores are multiplied into one
//! buffer (cuBLAS or candle's CPU kernel) and turned into probabilities in
//! place, in f32 whatever the storage dtype; the mask is applied by position
//! (causal, and each query's first visible key) and by flag (key padding),
//! not built. The graph keeps the output `P` (which `P·v` keeps anyway) and
//! the inputs `q`, `k` (kept by the ops that made them). Backward:
//! `dS = scale·P∘(dP − rowsum(P∘dP))` in one pass, then `dq = dS·k` and
//! `dk = dSᵀ·q`, a quarter of the key heads at a time
//! ([`PROBS_BACKWARD_CHUNKS`]): beside `dP`, a quarter of `dS` is alive.
//! This is what PyTorch's eager attention keeps (the softmax's output).

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::{cpu_slice, f, ProbsOptions};
use crate::custom_op::{CustomOp, Input, Kernel};

/// Groups the backward splits the key heads into (fewer when there are
/// fewer heads): `dS` is made for one group at a time.
pub const PROBS_BACKWARD_CHUNKS: usize = 4;

/// `softmax(q·kᵀ·scale)` over the keys each query sees: `q` `[b, H, s_q, d]`
/// and `k` `[b, KV, s_k, d]` of one dtype (f32, bf16, f16), `H` a multiple of
/// `KV` → `[b, H, s_q, s_k]`.
///
/// Grouped-query attention: query head `i` uses key head `i / (H/KV)`, with
/// no copy of `k` (the `H/KV` query heads of one key head are multiplied as
/// one `[(H/KV)·s_q, d]` matrix). `keep` (`[b, s_k]`, any dtype; zero masks
/// the key for every query of that batch row) adds key padding;
/// `key_start` (`[b, s_q]`, an integer dtype) hides from query `i` of batch
/// row `bb` the keys before `key_start[bb, i]` (packed documents: a query
/// sees its own document only). A row that sees no key is all zeros (no
/// gradient), as in [`crate::attention::flash_attention`]. `q` and `k` are
/// made contiguous (a copy when strided). Gradients flow to `q` and `k`.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use oomfix_strategies::nn::ops::{attention_probs, ProbsOptions};
///
/// let q = Var::randn(0f32, 1.0, (1, 2, 5, 4), &Device::Cpu)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 1, 5, 4), &Device::Cpu)?;
/// let opts = ProbsOptions { scale: 0.5, causal: true };
/// let p = attention_probs(q.as_tensor(), &k, None, None, opts)?;
/// assert_eq!(p.dims(), &[1, 2, 5, 5]);
/// // The first query sees only the first key.
/// assert_eq!(p.get(0)?.get(1)?.get(0)?.to_vec1::<f32>()?, [1.0, 0.0, 0.0, 0.0, 0.0]);
/// let grads = p.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&q).unwrap().dims(), &[1, 2, 5, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_probs(
    q: &Tensor,
    k: &Tensor,
    keep: Option<&Tensor>,
    key_start: Option<&Tensor>,
    opts: ProbsOptions,
) -> Result<Tensor> {
    let (b, h, s_q, d) = q.dims4()?;
    let (kb, kv, s_k, kd) = k.dims4()?;
    if (kb, kd) != (b, d) || kv == 0 || h % kv != 0 || k.dtype() != q.dtype() {
        candle_core::bail!(
            "attention_probs: q {:?} {:?} and k {:?} {:?} do not match",
            q.dims(),
            q.dtype(),
            k.dims(),
            k.dtype()
        );
    }
    let (q, k) = (q.contiguous()?, k.contiguous()?);
    let start = match key_start {
        None => None,
        Some(t) if t.dims() == [b, s_q] && t.dtype().is_int() => Some(
            t.to_device(q.device())?
                .to_dtype(DType::U32)?
                .contiguous()?,
        ),
        Some(t) => candle_core::bail!(
            "attention_probs: key starts must be [{b}, {s_q}] of an integer dtype, got {:?} {:?}",
            t.dims(),
            t.dtype()
        ),
    };
    let probs = Probs { opts, start };
    match keep {
        None => q.apply_op2(&k, CustomOp(probs)),
        Some(keep) => {
            if keep.dims() != [b, s_k] {
                candle_core::bail!(
                    "attention_probs: key padding must be [{b}, {s_k}], got {:?}",
                    keep.dims()
                );
            }
            let keep = match keep.dtype() {
                DType::U8 => keep.contiguous()?,
                _ => keep.ne(0u32)?,
            };
            q.apply_op3(&k, &keep, CustomOp(probs))
        }
    }
}

/// Forward: `q`, `k` (and the keep flags as bytes, nonzero keeps) → the
/// probabilities.
#[derive(Debug, Clone)]
struct Probs {
    opts: ProbsOptions,
    /// Each query's first visible key, `[b, s_q]` u32 contiguous on the
    /// inputs' device; `None`: key 0.
    start: Option<Tensor>,
}

/// Backward of the softmax: `P`, `dP` → `dS`.
struct ProbsGrad {
    scale: f32,
}

/// The shapes of one forward, from the layouts of `q` and `k`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    /// Query heads.
    h: usize,
    /// Key/value heads.
    kv: usize,
    s_q: usize,
    s_k: usize,
    d: usize,
}

impl Dims {
    fn new(ql: &Layout, kl: &Layout) -> Result<Dims> {
        if !ql.is_contiguous() || !kl.is_contiguous() {
            candle_core::bail!("attention_probs: q and k must be contiguous");
        }
        let (b, h, s_q, d) = ql.shape().dims4()?;
        let (_, kv, s_k, _) = kl.shape().dims4()?;
        Ok(Dims {
            b,
            h,
            kv,
            s_q,
            s_k,
            d,
        })
    }

    /// `[b, H, s_q, s_k]`.
    fn shape(&self) -> Shape {
        Shape::from((self.b, self.h, self.s_q, self.s_k))
    }

    /// The rows of the probabilities for the CUDA kernel.
    #[cfg(feature = "cuda")]
    fn geometry(&self) -> super::cuda::ProbsGeometry {
        super::cuda::ProbsGeometry {
            rows: self.b * self.h * self.s_q,
            s_q: self.s_q,
            s_k: self.s_k,
            rows_per_batch: self.h * self.s_q,
        }
    }

    /// The scores `q·kᵀ`: `q` viewed as `[b·KV, g·s_q, d]` times `kᵀ`
    /// `[b·KV, d, s_k]`, through the backend's batched product.
    fn scores<S: BackendStorage>(&self, q: (&S, &Layout), k: (&S, &Layout)) -> Result<S> {
        let (batch, m) = (self.b * self.kv, self.h / self.kv * self.s_q);
        let ql = Layout::contiguous_with_offset((batch, m, self.d), q.1.start_offset());
        let kl = Layout::contiguous_with_offset((batch, self.s_k, self.d), k.1.start_offset())
            .transpose(1, 2)?;
        q.0.matmul(k.0, (batch, m, self.s_k, self.d), &ql, &kl)
    }
}

/// Turns each row of `p` (`s_k` scores) into probabilities in place: see
/// `attention_probs` in `fused.cu`, which this mirrors. `start`: each
/// query's first visible key, `[b, s_q]`.
fn softmax_rows_cpu<T: WithDType>(
    p: &mut [T],
    (keep, start): (Option<&[u8]>, Option<&[u32]>),
    dims: &Dims,
    opts: ProbsOptions,
) {
    let (s_q, s_k) = (dims.s_q, dims.s_k);
    let per_batch = dims.h * s_q;
    p.par_chunks_mut(s_k.max(1))
        .enumerate()
        .for_each(|(row, p)| {
            let seen = if opts.causal {
                (row % s_q + s_k + 1).saturating_sub(s_q).min(s_k)
            } else {
                s_k
            };
            let flags = keep.map(|k| &k[row / per_batch * s_k..][..s_k]);
            let first = start.map_or(0, |st| st[row / per_batch * s_q + row % s_q] as usize);
            let visible = |j: usize| first <= j && j < seen && flags.is_none_or(|k| k[j] != 0);
            let mut m = f32::NEG_INFINITY;
            for (j, &x) in p.iter().enumerate() {
                if visible(j) {
                    m = m.max(f(x) * opts.scale);
                }
            }
            let mut l = 0f32;
            for (j, x) in p.iter().enumerate() {
                if visible(j) {
                    l += (f(*x) * opts.scale - m).exp();
                }
            }
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            for (j, x) in p.iter_mut().enumerate() {
                let v = if visible(j) {
                    (f(*x) * opts.scale - m).exp() * inv
                } else {
                    0.0
                };
                *x = T::from_f64(v as f64);
            }
        });
}

/// `scale·p∘(dp − rowsum(p∘dp))` row by row.
fn softmax_grad_cpu<T: WithDType>(p: &[T], dp: &[T], n: usize, scale: f32) -> CpuStorage {
    let mut ds = vec![T::zero(); p.len()];
    ds.par_chunks_mut(n.max(1))
        .zip(p.par_chunks(n.max(1)).zip(dp.par_chunks(n.max(1))))
        .for_each(|(ds, (p, dp))| {
            let dot: f32 = p.iter().zip(dp).map(|(&a, &b)| f(a) * f(b)).sum();
            for ((o, &a), &b) in ds.iter_mut().zip(p).zip(dp) {
                *o = T::from_f64((scale * f(a) * (f(b) - dot)) as f64);
            }
        });
    T::to_cpu_storage_owned(ds)
}

impl Probs {
    fn cpu(
        &self,
        q: Input<'_, CpuStorage>,
        k: Input<'_, CpuStorage>,
        keep: Option<Input<'_, CpuStorage>>,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = Dims::new(q.1, k.1)?;
        let scores = dims.scores(q, k)?;
        let keep = keep.map(|(s, l)| cpu_slice::<u8>(s, l)).transpose()?;
        let start = self.start.as_ref().map(|t| t.storage_and_layout());
        let start = match &start {
            None => None,
            Some((storage, layout)) => match &**storage {
                candle_core::Storage::Cpu(s) => Some(cpu_slice::<u32>(s, layout)?),
                _ => candle_core::bail!("attention_probs: the key starts are not on the CPU"),
            },
        };
        fn run<T: WithDType>(
            scores: CpuStorage,
            masks: (Option<&[u8]>, Option<&[u32]>),
            dims: &Dims,
            opts: ProbsOptions,
        ) -> Result<CpuStorage> {
            let mut p = T::cpu_storage_data(scores)?;
            softmax_rows_cpu(&mut p, masks, dims, opts);
            Ok(T::to_cpu_storage_owned(p))
        }
        let p = by_dtype!(scores.dtype(), run(scores, (keep, start), &dims, self.opts))?;
        Ok((p, dims.shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        q: Input<'_, CudaStorage>,
        k: Input<'_, CudaStorage>,
        keep: Option<Input<'_, CudaStorage>>,
    ) -> Result<(CudaStorage, Shape)> {
        let dims = Dims::new(q.1, k.1)?;
        let mut scores = dims.scores(q, k)?;
        let start = self.start.as_ref().map(|t| t.storage_and_layout());
        let start = match &start {
            None => None,
            Some((storage, layout)) => match &**storage {
                candle_core::Storage::Cuda(s) => Some((s, *layout)),
                _ => candle_core::bail!("attention_probs: the key starts are not on the device"),
            },
        };
        super::cuda::attention_probs(&mut scores, (keep, start), dims.geometry(), self.opts)?;
        Ok((scores, dims.shape()))
    }

    /// `dq`, `dk` from the probabilities `p` and their gradient `dp`, made
    /// for the `b·KV` key heads in [`PROBS_BACKWARD_CHUNKS`] groups, one after
    /// the other, so that one group's `dS` is alive at a time. The inputs are
    /// detached first: a product with a tensor that tracks gradients would
    /// keep its group's `dS` in the graph until the groups are joined.
    fn grads(&self, q: &Tensor, k: &Tensor, p: &Tensor, dp: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, h, s_q, d) = q.dims4()?;
        let (_, kv, s_k, _) = k.dims4()?;
        let (heads, rows) = (b * kv, h / kv * s_q);
        let grad = CustomOp(ProbsGrad {
            scale: self.opts.scale,
        });
        let p = p.detach().reshape((heads, rows, s_k))?;
        let dp = dp.detach().contiguous()?.reshape((heads, rows, s_k))?;
        let q = q.detach().reshape((heads, rows, d))?;
        let k = k.detach().reshape((heads, s_k, d))?;
        let per = heads.div_ceil(PROBS_BACKWARD_CHUNKS).max(1);
        let (mut dq, mut dk) = (Vec::new(), Vec::new());
        for start in (0..heads).step_by(per) {
            let len = per.min(heads - start);
            let ds = p
                .narrow(0, start, len)?
                .apply_op2_no_bwd(&dp.narrow(0, start, len)?, &grad)?;
            dq.push(ds.matmul(&k.narrow(0, start, len)?)?);
            dk.push(ds.t()?.matmul(&q.narrow(0, start, len)?)?);
        }
        Ok((
            Tensor::cat(&dq, 0)?.reshape((b, h, s_q, d))?,
            Tensor::cat(&dk, 0)?.reshape((b, kv, s_k, d))?,
        ))
    }
}

impl Kernel<2> for Probs {
    fn name(&self) -> &'static str {
        "oomfix-attention-probs"
    }

    fn cpu_fwd(&self, [q, k]: [Input<'_, CpuStorage>; 2]) -> Result<(CpuStorage, Shape)> {
        self.cpu(q, k, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [q, k]: [Input<'_, CudaStorage>; 2]) -> Result<(CudaStorage, Shape)> {
        self.cuda(q, k, None)
    }

    fn bwd(&self, [q, k]: [&Tensor; 2], p: &Tensor, dp: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let (dq, dk) = self.grads(q, k, p, dp)?;
        Ok([Some(dq), Some(dk)])
    }
}

/// With key padding: its flags are the third input.
impl Kernel<3> for Probs {
    fn name(&self) -> &'static str {
        "oomfix-attention-probs"
    }

    fn cpu_fwd(&self, [q, k, keep]: [Input<'_, CpuStorage>; 3]) -> Result<(CpuStorage, Shape)> {
        self.cpu(q, k, Some(keep))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [q, k, keep]: [Input<'_, CudaStorage>; 3]) -> Result<(CudaStorage, Shape)> {
        self.cuda(q, k, Some(keep))
    }

    fn bwd(&self, [q, k, _]: [&Tensor; 3], p: &Tensor, dp: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let (dq, dk) = self.grads(q, k, p, dp)?;
        Ok([Some(dq), Some(dk), None])
    }
}

impl Kernel<2> for ProbsGrad {
    fn name(&self) -> &'static str {
        "oomfix-attention-probs-backward"
    }

    fn cpu_fwd(
        &self,
        [(p, pl), (dp, dpl)]: [Input<'_, CpuStorage>; 2],
    ) -> Result<(CpuStorage, Shape)> {
        let n = pl.dims().last().copied().unwrap_or(1);
        fn run<T: WithDType>(
            p: (&CpuStorage, &Layout),
            dp: (&CpuStorage, &Layout),
            n: usize,
            scale: f32,
        ) -> Result<CpuStorage> {
            Ok(softmax_grad_cpu(
                cpu_slice::<T>(p.0, p.1)?,
                cpu_slice::<T>(dp.0, dp.1)?,
                n,
                scale,
            ))
        }
        let ds = by_dtype!(p.dtype(), run((p, pl), (dp, dpl), n, self.scale))?;
        Ok((ds, pl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [p, dp]: [Input<'_, CudaStorage>; 2]) -> Result<(CudaStorage, Shape)> {
        let ds = super::cuda::attention_probs_grad(p, dp, self.scale)?;
        Ok((ds, p.1.shape().clone()))
    }
}
